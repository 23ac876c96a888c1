"""The PyTorch DDP tutorial's three demos, each a short real run through ``run``.

Runs on the driver. Each demo trains through the same trainer as ``ray-ddp train`` and
then checks, from the run's metrics table, the property the tutorial demonstrates:
- basic: ToyModel trained with DDP; every rank ends with identical weights;
- checkpoint: rank 0 saves a checkpoint, a second run has every rank load it (each
  rank reports a fingerprint of what it loaded, compared with ``model.pt`` itself) and
  trains on, again ending with identical weights on every rank;
- model-parallel: ToyMpModel, its two stages over a device pair per worker (a GPU pair
  where a node has two GPUs, else both stages on the CPU), wrapped in DDP.

"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Optional
import torch
from ray_ddp.checkpoint.format import MODEL_FILE
from ray_ddp.checkpoint.verify import weights_hash
from ray_ddp.config.train import TrainConfig
from ray_ddp.driver.summary import RunSummary
from ray_ddp.driver.run import run
from ray_ddp.record.folder import METRICS_FILE, run_folder
from ray_ddp.storage import resolve_storage
from ray_ddp.record.metrics_table import read_metrics
from ray_ddp.models.builtin import ToyModel

# the demos' names live in config/choices.py, which `ray-ddp --help` imports without torch;
# importing them from here still works
from ray_ddp.config.choices import DEMOS


class DemoFailed(RuntimeError):
    """The property a demo shows did not hold: a bug, not a user mistake."""


@dataclass
class DemoSummary:
    """A demo that held: what it showed (``detail``) and the runs that showed it."""

    demo: str
    detail: str
    runs: list[RunSummary]


def run_demo(name: str, workers: Optional[int] = None, storage: str = "~/ray_ddp_runs",
             echo: Callable[[str], None] = print, quiet: bool = False,
             train: Callable[..., RunSummary] = run) -> DemoSummary:
    """Run demo ``name`` and check what it shows. ``train(cfg, echo=...)`` runs each of its
    runs: ``run``, on Ray (tests/helpers/gloo_run.py's ``train_in_gloo`` in the suite, where
    Ray is not what a demo tests)."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    base = dict(workers=workers, storage=storage, steps_per_epoch=10, report_every=5,
                name=f"demo-{name}-{stamp}", quiet=quiet)
    if name == "basic":
        summary = train(TrainConfig(model="toy", epochs=2, **base), echo=echo)
        detail = _check_identical_weights(summary)
        return DemoSummary(name, detail, [summary])
    if name == "checkpoint":
        first = train(TrainConfig(model="toy", epochs=1, **base), echo=echo)
        second = train(TrainConfig(model="toy", epochs=2, **base), echo=echo)
        loaded = _check_loaded_checkpoint(second)
        detail = f"{loaded}; {_check_identical_weights(second)}"
        return DemoSummary(name, detail, [first, second])
    if name == "model-parallel":
        summary = train(TrainConfig(model="toy-mp", epochs=2, **base), echo=echo)
        detail = (f"{summary.gpus_per_worker or 'CPU'} device(s) per worker; "
                  + _check_identical_weights(summary))
        return DemoSummary(name, detail, [summary])
    raise ValueError(f"unknown demo {name}")


def _metrics_rows(summary: RunSummary) -> list[dict]:
    store = resolve_storage(summary.path.rsplit("/", 1)[0])
    table = read_metrics(run_folder(store, summary.run))
    if table is None:
        raise DemoFailed(f"run {summary.run} left no {METRICS_FILE}")
    return table.to_pylist()


def _check_identical_weights(summary: RunSummary) -> str:
    rows = _metrics_rows(summary)
    last = max(r["step"] for r in rows)
    hashes = {r["rank"]: r["weights_hash"] for r in rows if r["step"] == last}
    if len(hashes) != summary.world_size or len(set(hashes.values())) != 1:
        raise DemoFailed(f"ranks ended with different weights: {hashes}")
    return f"all {len(hashes)} ranks hold identical weights (fingerprint {next(iter(hashes.values())):012x})"


def _check_loaded_checkpoint(summary: RunSummary) -> str:
    if summary.resumed_from is None:
        raise DemoFailed("the second run did not resume from the first run's checkpoint")
    store = resolve_storage(summary.resumed_from)
    with store.fs.open_input_file(f"{store.path}/{MODEL_FILE}") as f:
        weights = torch.load(f, weights_only=True)
    model = ToyModel()
    model.load_state_dict(weights)
    expected = weights_hash(model)
    loaded = {r["rank"]: r["loaded_hash"] for r in _metrics_rows(summary) if r["loaded_hash"] is not None}
    if len(loaded) != summary.world_size or set(loaded.values()) != {expected}:
        raise DemoFailed(f"ranks loaded {loaded}, but rank 0 saved {expected:012x}")
    return f"every rank loaded rank 0's checkpoint {summary.resumed_from.rsplit('/', 1)[-1]}"
