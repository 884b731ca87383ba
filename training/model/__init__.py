"""The model and its compute: the definition (gpt and gemma families), the jitted inner loop,
optimizer-state naming, the process-wide caches, held-out evaluation and the data-parallel
baseline."""
