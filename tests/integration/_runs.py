"""Helpers for real runs: a small config, and reading back what a run wrote."""

from __future__ import annotations

import pyarrow.parquet as pq

from ray_ddp import TrainConfig


def small(tmp, name, **kw) -> TrainConfig:
    """A few seconds of training: 2 workers, 3 epochs of 10 steps, a report every 5 steps,
    with LR warm-up and gradient clipping, so every resume test also shows that the
    schedule's state comes back (a restarted warm-up would change the weights)."""
    base = dict(workers=2, epochs=3, steps_per_epoch=10, batch_size=16, report_every=5,
                warmup_steps=3, clip_grad=1.0, storage=str(tmp), name=name, quiet=True)
    return TrainConfig(**{**base, **kw})


def rows_of(summary):
    return pq.read_table(summary.metrics).to_pylist()


def final_hashes(rows):
    """rank -> weights fingerprint at the last step of a metrics table."""
    last = max(r["step"] for r in rows)
    return {r["rank"]: r["weights_hash"] for r in rows if r["step"] == last}
