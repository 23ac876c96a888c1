"""The metrics and validation tables as Ray Train's controller keeps them between
reports: the open part of metrics.parquet, the (step, world size) of every window so far
(earlier commands' included, read once), and the validations. A restarted worker group
re-reports the steps it redoes: its windows replace the earlier attempt's. Runs in the
controller."""

from __future__ import annotations

from collections import Counter
from typing import Any, Optional

import pyarrow as pa

from ray_ddp.record.metrics_table import MetricsAppender, read_metrics
from ray_ddp.record.schema import EVAL_SCHEMA, eval_row
from ray_ddp.record.folder import RunFolder
from ray_ddp.storage import read_table, write_table


class RunTable:
    def __init__(self) -> None:
        self.rows = MetricsAppender()  # the open part of metrics.parquet and when to fold
        self.worlds: Optional[list[tuple[int, int]]] = None  # None until read from storage
        self.evals: list[dict[str, Any]] = []

    def load(self, folder: RunFolder) -> None:
        """What earlier commands (and this fit's earlier controller) left, once: each
        window's world size, and the validations (eval.parquet is small: rewritten whole)."""
        if self.worlds is not None:
            return
        table = read_metrics(folder)
        ranks = Counter([] if table is None else table.column("step").to_pylist())  # a row per rank per window
        self.worlds = sorted(ranks.items())
        self.rows.table_rows = 0 if table is None else table.num_rows
        evals = read_table(folder.fs, folder.evals)
        self.evals = [] if evals is None else evals.to_pylist()

    def world_before(self, first_step: int) -> Optional[tuple[int, int]]:
        """(step, world size) of the last window before ``first_step``, the windows from it
        on forgotten (they are reported again)."""
        self.worlds = [w for w in self.worlds if w[0] < first_step]
        return self.worlds[-1] if self.worlds else None

    def record(self, first_step: int, windows: list[list[dict[str, Any]]]) -> None:
        """The windows' rows (in the open part of metrics.parquet) and validations."""
        self.rows.add(first_step, [m for window in windows for m in window])
        self.evals = [r for r in self.evals if r["step"] < first_step]
        for window in windows:
            self.worlds.append((int(window[0]["step"]), len(window)))
            if "val_loss" in window[0]:
                self.evals.append(eval_row(window[0]))

    def write_rows(self, folder: RunFolder, seal: bool) -> None:
        self.rows.write(folder, seal=seal)

    def write_evals(self, folder: RunFolder) -> None:
        write_table(folder.fs, folder.evals, pa.Table.from_pylist(self.evals, schema=EVAL_SCHEMA))
