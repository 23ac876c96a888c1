"""Checkpoints: their format, the background writer, FSDP shards, which one to resume,
and which ones to keep (exporting one's model is ray_ddp/export/'s)."""
