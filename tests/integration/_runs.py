"""Helpers for real runs: a small config, and reading back what a run wrote."""

from __future__ import annotations

import threading

import pyarrow.parquet as pq

from ray_ddp import TrainConfig, run


def small(tmp, name, **kw) -> TrainConfig:
    """A few seconds of training: 2 workers, 3 epochs of 10 steps, a report every 5 steps,
    with LR warm-up and gradient clipping, so every resume test also shows that the
    schedule's state comes back (a restarted warm-up would change the weights). The hang
    watch is off (its actor is a process of its own, ~1.3 CPU-s): the runs that meet a
    failure or a hang (test_faults.py, test_hangs.py) turn it on, as their events read the
    step the workers' heartbeats reached."""
    base = dict(workers=2, epochs=3, steps_per_epoch=10, batch_size=16, report_every=5,
                warmup_steps=3, clip_grad=1.0, storage=str(tmp), name=name, quiet=True, hang_timeout=0)
    return TrainConfig(**{**base, **kw})


def full_config(storage, val_data, **kw) -> TrainConfig:
    """conftest.py's full_run: small()'s toy whose rank 1 straggles (300 ms more a forward:
    the same parameters, so the same weights as ``toy``), validated every epoch, with
    TensorBoard and W&B (offline: tests/conftest.py), stored through a file:// URI (its
    summary's locations are URIs)."""
    return small(f"file://{storage}", "full", model="user_models:slow_on_rank_one", val_data=val_data,
                 tensorboard=True, wandb="ray-ddp-tests", quiet=False, **kw)


def rows_of(summary):
    return pq.read_table(summary.metrics).to_pylist()


def final_hashes(rows):
    """rank -> weights fingerprint at the last step of a metrics table."""
    last = max(r["step"] for r in rows)
    return {r["rank"]: r["weights_hash"] for r in rows if r["step"] == last}


def run_in_thread(cfg, job=None) -> tuple[threading.Thread, dict]:
    """Start ``run(cfg)`` (or ``job()``, which returns a summary) in a thread: runs side
    by side on the shared Ray overlap one's start-up with another's training.
    ``summary_of`` joins it."""
    result: dict = {}

    def train():
        try:
            result["summary"] = job() if job is not None else run(cfg)
        except BaseException as err:  # surfaced by summary_of
            result["error"] = err

    thread = threading.Thread(target=train)
    thread.start()
    return thread, result


def summary_of(thread, result):
    thread.join(timeout=400)
    assert "error" not in result, result.get("error")
    return result["summary"]
