"""Bringing your own DDP code: ``ray_ddp.spawn`` and ``ray-ddp launch``."""
