"""What a parquet data set holds, from its footers: columns, rows, the task, and for
labels and tokens their range from row-group statistics, so a large data set is never
read whole to learn a size. Runs on the driver and on workers.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional
import pyarrow as pa
import pyarrow.compute as pc
from ray_ddp.errors import ConfigError
from ray_ddp.storage import resolve_storage


@dataclass(frozen=True)
class CheckedTable:
    """A checked parquet data set: where, which columns, how many rows, the dims, and the
    task its targets make: float targets regression, one integer target column
    classification (``num_classes``: the largest label + 1), a column of token-id lists
    a language model's sequences (``input_dim``: the shortest sequence; ``num_classes``:
    the largest token id + 1). Where row groups without statistics were not read (the
    count was given), ``num_classes`` is at least the given count, and reading a row
    group refuses a label or token id outside it."""

    path: str
    features: tuple[str, ...]
    targets: tuple[str, ...]
    rows: int
    input_dim: int
    output_dim: int
    task: str = "regression"
    num_classes: Optional[int] = None


def open_dataset(path: str):
    import pyarrow.dataset as pads

    store = resolve_storage(path)
    from pyarrow.fs import FileType

    info = store.fs.get_file_info(store.path)
    if info.type == FileType.NotFound:
        raise ConfigError(f"--data {path} does not exist; give a parquet file or a folder of them")
    try:
        return pads.dataset(store.path, filesystem=store.fs, format="parquet")
    except (pa.ArrowInvalid, OSError) as err:
        raise ConfigError(f"--data {path} is not readable as parquet ({str(err).splitlines()[0]}); "
                          "give parquet files") from None


def pick_columns(names: list[str], given: Optional[str], pattern: str, what: str, path: str) -> tuple[str, ...]:
    if given:
        cols = tuple(c.strip() for c in given.split(",") if c.strip())
        missing = [c for c in cols if c not in names]
        if missing:
            raise ConfigError(f"--data {path} has no column '{missing[0]}'; its columns are "
                              f"{', '.join(names)}; pick {what} with --{what}")
        return cols
    found = sorted((n for n in names if re.fullmatch(pattern, n)), key=lambda n: int(n[1:]))
    if not found:
        raise ConfigError(f"--data {path}: no {what} columns given and none named like "
                          f"{pattern[0]}0, {pattern[0]}1, ...; pass --{what} COL[,COL...]")
    return tuple(found)


def column_width(field: pa.Field, path: str) -> int:
    t = field.type
    if pa.types.is_fixed_size_list(t) and (pa.types.is_floating(t.value_type) or pa.types.is_integer(t.value_type)):
        return t.list_size
    if pa.types.is_floating(t) or pa.types.is_integer(t) or pa.types.is_boolean(t):
        return 1
    raise ConfigError(f"--data {path}: column '{field.name}' is {t}; features and targets must be "
                      "numbers (or fixed-size lists of numbers)")


def inspect_table(path: str, features: Optional[str], target: Optional[str],
                  task: Optional[str] = None, *, stream: bool = False,
                  num_classes: Optional[int] = None, vocab_size: Optional[int] = None) -> CheckedTable:
    """Check a parquet data set on the driver; raise ConfigError with one line if unusable.
    ``task``: the one asked for, or None to take it from the target columns.

    Reads the footers, not the rows: the label or token range comes from the row groups'
    statistics; a row group without them is read alone, or not at all when the count is
    known (``num_classes`` for labels, ``vocab_size`` for token ids). ``stream``: a
    sequence length the schema does not fix is the first row's (the rows are not all in
    memory to compare; a shorter row is refused when its row group is read)."""
    ds = open_dataset(path)
    try:
        schema = ds.schema
        rows = ds.count_rows()
    except (pa.ArrowInvalid, OSError) as err:
        raise ConfigError(f"--data {path} is not readable as parquet ({str(err).splitlines()[0]})") from None
    names = schema.names
    if task == "lm":
        return _inspect_token_table(ds, path, features or "tokens", rows, stream, vocab_size)
    feats = pick_columns(names, features, r"f\d+", "features", path)
    targs = pick_columns(names, target, r"t\d+", "target", path)
    if rows == 0:
        raise ConfigError(f"--data {path} has no rows")
    integer_label = len(targs) == 1 and pa.types.is_integer(schema.field(targs[0]).type)
    task = task or ("classification" if integer_label else "regression")
    classes = None
    if task == "classification":
        if not integer_label:
            raise ConfigError(f"--task classification needs one integer label column; --data {path} "
                              f"has target {', '.join(targs)} ({schema.field(targs[0]).type}); "
                              "pass --target LABEL_COLUMN")
        low, high, skipped = _find_value_range(ds, targs[0], known=num_classes)
        if low is not None and low < 0:
            raise ConfigError(f"--data {path}: class labels must be 0 or more, found {low}")
        if high is None and not skipped:
            raise ConfigError(f"--data {path}: column '{targs[0]}' holds no labels, only nulls")
        classes = _count_classes(high, num_classes if skipped else None)
    return CheckedTable(path, feats, targs, rows,
                       sum(column_width(schema.field(c), path) for c in feats),
                       sum(column_width(schema.field(c), path) for c in targs), task, classes)


def _inspect_token_table(ds, path: str, column: str, rows: int, stream: bool,
                         vocab_size: Optional[int]) -> CheckedTable:
    """A language model's data: one column of token-id lists; the targets are the inputs
    shifted by one token, so there is no target column."""
    if column not in ds.schema.names:
        raise ConfigError(f"--data {path} has no column '{column}'; its columns are "
                          f"{', '.join(ds.schema.names)}; name the token-id list column with --features")
    t = ds.schema.field(column).type
    if not ((pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t))
            and pa.types.is_integer(t.value_type)):
        raise ConfigError(f"--data {path}: column '{column}' is {t}; --task lm needs a column of "
                          "token-id lists (list<int>)")
    if rows == 0:
        raise ConfigError(f"--data {path} has no rows")
    if pa.types.is_fixed_size_list(t):
        shortest = t.list_size
    elif stream:
        shortest = _measure_first_row(ds, column)
    else:  # the rows are loaded anyway: every row's length, one row group at a time
        shortest = _measure_shortest_row(ds, column)
    low, high, skipped = _find_value_range(ds, column, known=vocab_size)
    if low is not None and low < 0:
        raise ConfigError(f"--data {path}: token ids must be 0 or more, found {low}")
    return CheckedTable(path, (column,), (), rows, int(shortest), 0, "lm",
                       num_classes=_count_classes(high, vocab_size if skipped else None))


def _walk_row_groups(ds, column: str):
    """(fragment, row group, the column's chunk metadata) of every non-empty row group,
    files in path order (as ``list_row_groups``): the footers only."""
    for fragment in sorted(ds.get_fragments(), key=lambda f: f.path):
        meta = fragment.metadata
        # files may order their columns differently
        leaf = _find_leaf(fragment.physical_schema, column, fragment.path)
        for group in range(meta.num_row_groups):
            if meta.row_group(group).num_rows > 0:
                yield fragment, group, meta.row_group(group).column(leaf)


def _read_column(fragment, group: int, column: str) -> pa.ChunkedArray:
    """One column of one row group: the most a check ever holds in memory."""
    import pyarrow.parquet as pq

    with fragment.filesystem.open_input_file(fragment.path) as f:
        # the footer already parsed: a file of many row groups is not parsed once per group
        return pq.ParquetFile(f, metadata=fragment.metadata).read_row_group(group, columns=[column]).column(0)


def _count_leaves(t: pa.DataType) -> int:
    """Parquet leaf columns an arrow type is stored as (the statistics are per leaf)."""
    if pa.types.is_struct(t):
        return sum(_count_leaves(t.field(i).type) for i in range(t.num_fields))
    if pa.types.is_map(t):
        return _count_leaves(t.key_type) + _count_leaves(t.item_type)
    if pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t):
        return _count_leaves(t.value_type)
    return 1


def _find_leaf(schema: pa.Schema, column: str, path: str) -> int:
    """The parquet leaf of a number column or of a list column's items: leaves are numbered
    depth first in field order (a dotted path can be ambiguous, the position cannot)."""
    index = schema.get_field_index(column)
    if index < 0:
        raise ConfigError(f"--data: {path} has no column '{column}' (or has it twice); every file "
                          "of a data set needs it once")
    return sum(_count_leaves(schema.field(i).type) for i in range(index))


def _count_classes(high: Optional[int], known: Optional[int]) -> int:
    """Classes (or a vocabulary) for values up to ``high`` (None: no values), and at least
    ``known`` where row groups went unread."""
    return max(high + 1 if high is not None else 0, known or 0)


def _find_value_range(ds, column: str, known: Optional[int]) -> tuple[Optional[int], Optional[int], bool]:
    """The smallest and largest value of an integer column, or of a list column's items
    (None, None: no values), from each row group's min/max statistics, and whether a row
    group went unread. A row group without them is read alone; with ``known`` (the count
    the values must stay below) it is skipped, and reading it for training checks its
    values instead."""
    low = high = None
    skipped = False
    for fragment, group, chunk in _walk_row_groups(ds, column):
        stats = chunk.statistics
        if stats is not None and stats.has_min_max:
            lo, hi = stats.min, stats.max
        elif stats is not None and stats.num_values == 0:
            continue  # only nulls or empty lists
        elif known is not None:
            skipped = True
            continue
        else:
            values = _read_column(fragment, group, column)
            if not pa.types.is_integer(values.type):
                values = pc.list_flatten(values)
            lo, hi = pc.min(values).as_py(), pc.max(values).as_py()
            if lo is None:
                continue
        low = lo if low is None else min(low, lo)
        high = hi if high is None else max(high, hi)
    return low, high, skipped


def _measure_shortest_row(ds, column: str) -> int:
    """The shortest sequence of a token-id list column (null rows aside; none: 0)."""
    lengths = [pc.min(pc.list_value_length(_read_column(fragment, group, column))).as_py()
               for fragment, group, _ in _walk_row_groups(ds, column)]
    return min((n for n in lengths if n is not None), default=0)


def _measure_first_row(ds, column: str) -> int:
    """The first row's sequence length (a null row: 0), reading the first pages only."""
    import pyarrow.parquet as pq

    fragment, group, _ = next(_walk_row_groups(ds, column))
    with fragment.filesystem.open_input_file(fragment.path) as f:
        # buffered and not pre-buffered: otherwise the reader fetches the row group's
        # whole column chunk for one row
        batch = next(pq.ParquetFile(f, buffer_size=1 << 16, pre_buffer=False).iter_batches(
            batch_size=1, row_groups=[group], columns=[column]))
    return pc.list_value_length(batch.column(0))[0].as_py() or 0
