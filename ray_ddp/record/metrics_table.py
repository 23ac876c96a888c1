"""metrics.parquet, appended to rather than rewritten: the metrics callback (in Ray
Train's controller) keeps the rows reported since the last seal in one open part beside
the table (``metrics.parts/part-<n>.parquet``), rewritten at each report, so no
reported row is only in memory: a failed fit, an interrupted one, or a driver killed
with its controller loses none. A part is sealed at each checkpoint, or once it holds
``SEAL_ROWS`` rows (a report rewrites at most that many), and a new one opened. The
sealed parts are folded into metrics.parquet once they hold as many rows as the table
(the first seal's at once, then at twice the rows, four times...: each row is rewritten
a bounded number of times, so a run's writes grow with its rows, not with rows x
checkpoints), and by the driver when a fit ends. Every reader that must see all the
rows reads the table and its parts as one (``read_metrics``).

A part says from which step it replaces what came before (``from_step``, in its
metadata): a worker group restarted from a checkpoint re-reports the steps it redoes,
and those rows replace the earlier attempt's.
"""

from __future__ import annotations

from typing import Any, Optional

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.fs as pafs

from ray_ddp.record.schema import COLUMNS, SCHEMA
from ray_ddp.record.folder import RunFolder
from ray_ddp.storage import read_table, write_table

FROM_STEP = b"from_step"
# The most rows an open part holds before it is sealed: what one report may rewrite.
SEAL_ROWS = 4096


class MetricsAppender:
    """The rows of the open part (reported since the last seal), the step they replace
    from, and how many rows the table and the sealed parts hold (when to fold)."""

    def __init__(self, table_rows: int = 0):
        self._rows: list[dict[str, Any]] = []
        self._from_step: Optional[int] = None
        self._next_part: Optional[int] = None  # listed once, at the first write
        self._open_part: Optional[int] = None  # the open part's number, once written
        self.table_rows, self.part_rows = table_rows, 0

    def add(self, first_step: int, rows: list[dict[str, Any]]) -> None:
        """A report's rows, its windows' rows from ``first_step`` on: they replace any
        rows of ``first_step`` or later (a restarted group redoing steps)."""
        self._rows = [r for r in self._rows if r["step"] < first_step]
        self._rows += [{c: r.get(c) for c in COLUMNS} for r in rows]
        self._from_step = first_step if self._from_step is None else min(self._from_step, first_step)

    def write(self, folder: RunFolder, seal: bool) -> None:
        """The open part's rows to storage (nothing if none came since the last seal);
        ``seal`` (a checkpoint), or a full part: sealed, and the sealed parts folded into
        the table once they hold as many rows as it does."""
        if self._from_step is None:
            return
        table = pa.Table.from_pylist(self._rows, schema=SCHEMA)
        table = table.replace_schema_metadata({FROM_STEP: str(self._from_step).encode()})
        if self._open_part is None:
            if self._next_part is None:
                folder.fs.create_dir(folder.metrics_parts, recursive=True)  # a local disk needs the folder
                # after the parts there (a restarted controller's callback starts afresh)
                self._next_part = 1 + max((_part_number(p) for p in _part_paths(folder)), default=-1)
            self._open_part, self._next_part = self._next_part, self._next_part + 1
        write_table(folder.fs, folder.metrics_part(self._open_part), table)
        if not seal and table.num_rows < SEAL_ROWS:
            return
        self._rows, self._from_step, self._open_part = [], None, None
        self.part_rows += table.num_rows
        if self.part_rows >= self.table_rows:
            self.table_rows = fold_metrics(folder)
            self.part_rows, self._next_part = 0, None  # the parts' folder is gone


def read_metrics(folder: RunFolder, parts: Optional[list[str]] = None,
                 last: Optional[pa.Table] = None) -> Optional[pa.Table]:
    """The run's metrics: metrics.parquet with its parts applied in order (``parts``:
    their paths, if listed already), then ``last`` (a part not written); None if the run
    has none of them."""
    # the parts listed before the table is read: a fold in between leaves rows in the new
    # table that a part listed already holds too, and a part applies twice as once
    parts = _part_paths(folder) if parts is None else parts
    table = read_table(folder.fs, folder.metrics)
    later = [read_table(folder.fs, path) for path in parts]
    for part in [p for p in later if p is not None] + ([last] if last is not None else []):  # None: folded meanwhile
        from_step = int((part.schema.metadata or {}).get(FROM_STEP, b"0"))
        part = part.replace_schema_metadata(None)
        table = part if table is None else pa.concat_tables(
            [table.filter(pc.less(table["step"], from_step)), part], promote_options="permissive")
    return table


def fold_metrics(folder: RunFolder, last: Optional[pa.Table] = None) -> int:
    """Write the parts (and ``last``, a part not written) into metrics.parquet and
    delete them, by the one writer: the callback, or the driver once a fit has ended;
    the table's rows."""
    parts = _part_paths(folder)
    if not parts and last is None:
        table = read_table(folder.fs, folder.metrics)
        return 0 if table is None else table.num_rows
    table = read_metrics(folder, parts, last)
    write_table(folder.fs, folder.metrics, table)  # atomic: a reader sees the old table or the new
    for path in parts:  # only those folded: one written since (a controller still alive) stays
        folder.fs.delete_file(path)
    if parts and not _part_paths(folder):
        folder.fs.delete_dir(folder.metrics_parts)
    return table.num_rows


def _part_paths(folder: RunFolder) -> list[str]:
    """The parts, oldest first."""
    found = folder.fs.get_file_info(pafs.FileSelector(folder.metrics_parts, allow_not_found=True))
    return sorted(f.path for f in found if f.type == pafs.FileType.File and f.path.endswith(".parquet"))


def _part_number(path: str) -> int:
    return int(path.rsplit("part-", 1)[1].split(".")[0])
