"""Training data from files and from users: parquet through pyarrow, and map-style torch
Datasets from ``package.module:callable``; plus ``ray-ddp data synth``.

Runs on the driver (to check a data set before any worker starts: it exists, is parquet,
has rows, has the columns and they are numbers; one line otherwise) and on each worker:
either to load the whole table into memory (the map-style path, for data that fits in a
worker's memory) or, with ``--stream``, to list its row groups and read them one at a
time. The check reads the parquet footers, not the data: rows from the metadata, the
largest label or token id from each row group's statistics (a row group without them is
read alone, never the whole column), so data larger than memory can be checked. Paths
may be local or pyarrow URIs, like ``--storage``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Optional

import pyarrow as pa
import pyarrow.compute as pc
import torch

from .config import ConfigError


@dataclass(frozen=True)
class TableConfig:
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


def _dataset(path: str):
    import pyarrow.dataset as pads

    from .storage import resolve_storage

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


def _pick(names: list[str], given: Optional[str], pattern: str, what: str, path: str) -> tuple[str, ...]:
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


def _width(field: pa.Field, path: str) -> int:
    t = field.type
    if pa.types.is_fixed_size_list(t) and (pa.types.is_floating(t.value_type) or pa.types.is_integer(t.value_type)):
        return t.list_size
    if pa.types.is_floating(t) or pa.types.is_integer(t) or pa.types.is_boolean(t):
        return 1
    raise ConfigError(f"--data {path}: column '{field.name}' is {t}; features and targets must be "
                      "numbers (or fixed-size lists of numbers)")


def inspect_table(path: str, features: Optional[str], target: Optional[str],
                  task: Optional[str] = None, *, stream: bool = False,
                  num_classes: Optional[int] = None, vocab_size: Optional[int] = None) -> TableConfig:
    """Check a parquet data set on the driver; raise ConfigError with one line if unusable.
    ``task``: the one asked for, or None to take it from the target columns.

    Reads the footers, not the rows: the label or token range comes from the row groups'
    statistics; a row group without them is read alone, or not at all when the count is
    known (``num_classes`` for labels, ``vocab_size`` for token ids). ``stream``: a
    sequence length the schema does not fix is the first row's (the rows are not all in
    memory to compare; a shorter row is refused when its row group is read)."""
    ds = _dataset(path)
    try:
        schema = ds.schema
        rows = ds.count_rows()
    except (pa.ArrowInvalid, OSError) as err:
        raise ConfigError(f"--data {path} is not readable as parquet ({str(err).splitlines()[0]})") from None
    names = schema.names
    if task == "lm":
        return _inspect_token_table(ds, path, features or "tokens", rows, stream, vocab_size)
    feats = _pick(names, features, r"f\d+", "features", path)
    targs = _pick(names, target, r"t\d+", "target", path)
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
    return TableConfig(path, feats, targs, rows,
                       sum(_width(schema.field(c), path) for c in feats),
                       sum(_width(schema.field(c), path) for c in targs), task, classes)


def _inspect_token_table(ds, path: str, column: str, rows: int, stream: bool,
                         vocab_size: Optional[int]) -> TableConfig:
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
    return TableConfig(path, (column,), (), rows, int(shortest), 0, "lm",
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


def _columns_to_tensor(table: pa.Table, cols: tuple[str, ...]) -> torch.Tensor:
    parts = []
    for c in cols:
        col = table.column(c).combine_chunks()
        if pa.types.is_fixed_size_list(col.type):
            width = col.type.list_size
            parts.append(torch.from_numpy(col.flatten().to_numpy(zero_copy_only=False)
                                          .reshape(-1, width).astype("float32")))
        else:
            parts.append(torch.from_numpy(col.to_numpy(zero_copy_only=False).astype("float32")).unsqueeze(1))
    return torch.cat(parts, dim=1)


def load_table(table: TableConfig, seq_len: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """The whole data set as tensors (inputs, targets), rows in file order: float32
    inputs and targets for regression, int64 labels for classification, and for a
    language model int64 tokens, each row's first ``seq_len`` as inputs and the same
    shifted by one as targets."""
    data = _dataset(table.path).to_table(columns=list(dict.fromkeys(table.features + table.targets)))
    return _to_tensors(data, table, seq_len, f"--data {table.path}")


def _to_tensors(data: pa.Table, table: TableConfig, seq_len: int,
                where: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``where``: the rows' place, for the one line that refuses them."""
    if table.task == "lm":
        tokens = data.column(table.features[0]).combine_chunks()
        # a list length the schema does not fix was checked on one row only (--stream)
        if tokens.null_count:
            raise ConfigError(f"{where}: a sequence is null; --task lm needs token ids in every row")
        shortest = pc.min(pc.list_value_length(tokens)).as_py()
        if shortest is not None and shortest < seq_len + 1:
            raise ConfigError(f"{where}: a sequence has {shortest} tokens; --seq-len {seq_len} "
                              f"needs {seq_len + 1}; lower --seq-len")
        ids = torch.from_numpy(pc.list_flatten(pc.list_slice(tokens, 0, seq_len + 1)).to_numpy(
            zero_copy_only=False).astype("int64")).reshape(len(data), seq_len + 1)
        _check_range(ids, table.num_classes, where, "token ids", "--vocab-size")
        return ids[:, :-1], ids[:, 1:]
    x = _columns_to_tensor(data, table.features)
    if table.task == "classification":
        labels = torch.from_numpy(data.column(table.targets[0]).combine_chunks()
                                  .to_numpy(zero_copy_only=False).astype("int64"))
        _check_range(labels, table.num_classes, where, "class labels", "--num-classes")
        return x, labels
    return x, _columns_to_tensor(data, table.targets)


def _check_range(values: torch.Tensor, count: Optional[int], where: str, what: str, flag: str) -> None:
    """Refuse a value outside 0 .. count-1: row groups without statistics may not have been
    checked at start-up, and an embedding or a loss given one fails far less clearly."""
    if count is None or values.numel() == 0:
        return
    low, high = int(values.min()), int(values.max())
    if low < 0 or high >= count:
        raise ConfigError(f"{where}: {what} must be 0 .. {count - 1}, found {low if low < 0 else high}; "
                          f"raise {flag} or fix the data")


def list_row_groups(table: TableConfig) -> list[tuple[str, int, int]]:
    """Every row group of the data set as (file, row group, rows), in file order: the
    units ``--stream`` shuffles and reads (metadata only, no rows are read)."""
    groups = []
    for fragment in sorted(_dataset(table.path).get_fragments(), key=lambda f: f.path):
        for piece in fragment.split_by_row_group():
            info = piece.row_groups[0]
            groups.append((fragment.path, info.id, info.num_rows))
    return [g for g in groups if g[2] > 0]


def row_group_reader(table: TableConfig, seq_len: int = 0):
    """read(file, row group) -> (inputs, targets) as float32 tensors, for --stream."""
    import pyarrow.parquet as pq

    from .storage import resolve_storage

    fs = resolve_storage(table.path).fs
    columns = list(dict.fromkeys(table.features + table.targets))

    def read(path: str, row_group: int) -> tuple[torch.Tensor, torch.Tensor]:
        with fs.open_input_file(path) as f:
            data = pq.ParquetFile(f).read_row_group(row_group, columns=columns)
        return _to_tensors(data, table, seq_len, f"{path} row group {row_group}")

    return read


def load_user_dataset(spec: str):
    """``package.module:callable`` returning a map-style Dataset of (input, target) pairs."""
    from .models import load_callable

    fn = load_callable(spec, what="dataset")
    try:
        ds = fn()
    except Exception as err:
        raise ConfigError(f"dataset '{spec}' raised {type(err).__name__}: {err}") from None
    return check_dataset(ds, f"dataset '{spec}'")


def check_dataset(ds, what: str):
    """Refuse, in one line, what is not a non-empty map-style Dataset of (input, target) pairs."""
    if not hasattr(ds, "__getitem__") or not hasattr(ds, "__len__"):
        raise ConfigError(f"{what} is {type(ds).__name__}, not a map-style Dataset "
                          "(it needs __len__ and __getitem__)")
    if len(ds) == 0:
        raise ConfigError(f"{what} is empty")
    item = ds[0]
    if not (isinstance(item, (tuple, list)) and len(item) == 2):
        raise ConfigError(f"{what}: items must be (input, target) pairs")
    return ds


def write_synthetic(out: str, rows: int, features: int, targets: int, files: int = 1,
                    seed: int = 0, row_group_rows: int = 8192, task: str = "regression",
                    classes: int = 10, seq_len: int = 64, vocab_size: int = 256) -> list[str]:
    """A data set a model can really learn, written as parquet (row groups of
    ``row_group_rows`` rows, what --stream shuffles and reads one at a time):
    - regression: columns id, f0..f{F-1}, t0..t{T-1} (float32), the targets from a fixed
      random teacher network (a 2-layer tanh MLP) plus a little noise;
    - classification: id, f0..f{F-1} and an int64 label t0, the argmax of such a
      teacher's ``classes`` outputs;
    - lm: id and ``tokens``, sequences of ``seq_len + 1`` token ids walked on a fixed random
      Markov chain over ``vocab_size`` tokens (each token has a few likely successors),
      so a language model can learn what comes next."""
    for name, value in (("rows", rows), ("features", features), ("targets", targets), ("files", files),
                        ("row-group-rows", row_group_rows), ("classes", classes), ("seq-len", seq_len),
                        ("vocab-size", vocab_size)):
        if value <= 0:
            raise ConfigError(f"--{name} must be a positive integer, got {value}")
    if files > rows:
        raise ConfigError(f"--files {files} is more than --rows {rows}")
    if task == "classification" and classes < 2:
        raise ConfigError(f"--classes must be 2 or more, got {classes}")
    g = torch.Generator().manual_seed(seed)
    columns: dict[str, Any] = {"id": pa.array(range(rows), type=pa.int64())}
    if task == "lm":
        columns["tokens"] = pa.FixedSizeListArray.from_arrays(
            pa.array(markov_tokens(g, rows, seq_len + 1, vocab_size).reshape(-1).numpy()), seq_len + 1)
    else:
        outputs = classes if task == "classification" else targets
        hidden = max(16, features)
        w1 = torch.randn(features, hidden, generator=g) / features**0.5
        w2 = torch.randn(hidden, outputs, generator=g) / hidden**0.5
        x = torch.randn(rows, features, generator=g)
        y = torch.tanh(x @ w1) @ w2
        columns.update({f"f{i}": pa.array(x[:, i].numpy()) for i in range(features)})
        if task == "classification":
            columns["t0"] = pa.array(y.argmax(dim=1).numpy().astype("int64"))
        else:
            y = y + 0.01 * torch.randn(rows, targets, generator=g)
            columns.update({f"t{i}": pa.array(y[:, i].numpy()) for i in range(targets)})
    return _write_parquet(out, pa.table(columns), files, row_group_rows)


def markov_tokens(g: torch.Generator, rows: int, length: int, vocab: int) -> torch.Tensor:
    """``rows`` sequences of ``length`` tokens from a fixed random Markov chain: each
    token has 4 likely successors (together 90% of the probability)."""
    likely = torch.stack([torch.randperm(vocab, generator=g)[:4] for _ in range(vocab)])
    probs = torch.full((vocab, vocab), 0.1 / vocab)
    probs.scatter_add_(1, likely, torch.full((vocab, 4), 0.9 / 4))
    seqs = torch.empty(rows, length, dtype=torch.int64)
    seqs[:, 0] = torch.randint(vocab, (rows,), generator=g)
    for t in range(1, length):
        seqs[:, t] = torch.multinomial(probs[seqs[:, t - 1]], 1, generator=g).squeeze(1)
    return seqs


def _write_parquet(out: str, table: pa.Table, files: int, row_group_rows: int) -> list[str]:
    import pyarrow.parquet as pq

    from .storage import resolve_storage

    rows = table.num_rows
    store = resolve_storage(out)
    single = files == 1 and out.endswith(".parquet")
    folder = store.path.rsplit("/", 1)[0] if single else store.path
    store.fs.create_dir(folder, recursive=True)
    written = []
    bounds = [rows * k // files for k in range(files + 1)]
    for k in range(files):
        path = store.path if single else f"{store.path}/part-{k:05d}.parquet"
        with store.fs.open_output_stream(path) as f:
            pq.write_table(table.slice(bounds[k], bounds[k + 1] - bounds[k]), f, row_group_size=row_group_rows)
        written.append(path)
    return written


# ------------------------------------------------------------------------------- text
def is_text(path: str) -> bool:
    """Text data for a language model: a .txt file, or a folder of .txt files."""
    from pyarrow.fs import FileSelector, FileType

    from .storage import resolve_storage

    if path.endswith(".txt"):
        return True
    store = resolve_storage(path)
    try:
        if store.fs.get_file_info(store.path).type != FileType.Directory:
            return False
        return any(i.path.endswith(".txt") for i in store.fs.get_file_info(FileSelector(store.path)))
    except OSError:
        return False


def _text_files(path: str):
    """(filesystem, the .txt file infos of ``path`` in name order): a file, or a folder's."""
    from pyarrow.fs import FileSelector, FileType

    from .storage import resolve_storage

    store = resolve_storage(path)
    info = store.fs.get_file_info(store.path)
    if info.type == FileType.NotFound:
        raise ConfigError(f"--data {path} does not exist; give a .txt file or a folder of them")
    files = [info] if info.type == FileType.File else sorted(
        (i for i in store.fs.get_file_info(FileSelector(store.path)) if i.path.endswith(".txt")),
        key=lambda i: i.path)
    return store.fs, files


def text_size(path: str) -> int:
    """Bytes of text at ``path``, from the files' metadata (the driver reads no text)."""
    return sum(i.size for i in _text_files(path)[1])


def read_text_bytes(path: str) -> torch.Tensor:
    """The bytes of a .txt file, or of a folder's .txt files in name order, as uint8."""
    fs, files = _text_files(path)
    chunks = []
    for info in files:
        name = info.path
        with fs.open_input_stream(name) as f:
            chunks.append(f.read())
    data = b"".join(chunks)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.zeros(0, dtype=torch.uint8)


def text_windows(data: torch.Tensor, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Byte-level tokens cut into windows of ``seq_len + 1`` (stride ``seq_len``, so every
    byte after the first is a target once): inputs and the targets one byte on."""
    rows = (len(data) - 1) // seq_len
    ids = data.long()
    x = ids[: rows * seq_len].reshape(rows, seq_len)
    y = ids[1: rows * seq_len + 1].reshape(rows, seq_len)
    return x, y
