"""``ray-ddp tune``: Ray Tune over ray-ddp runs (the search space, the trials, the ranking)."""
