"""Checkpoints: their format, the background writer, FSDP shards, which one to resume,
which ones to keep, and exporting the model."""
