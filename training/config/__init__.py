"""What an experiment is: the typed, validated config and its sections, the name rule, the TPU
catalogue and the scavenging rules. Imports nothing else from `training`."""
