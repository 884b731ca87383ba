"""Training data: corpora, tokenization, per-island shards, the resumable cursor, the eval split."""
