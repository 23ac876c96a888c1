"""Training data from files and from users: parquet through pyarrow, and map-style torch
Datasets from ``package.module:callable``; plus ``ray-ddp data synth``.

Runs on the driver (to check a data set before any worker starts: it exists, is parquet,
has rows, has the columns and they are numbers; one line otherwise) and on each worker:
either to load the whole table into memory (the map-style path, for data that fits in a
worker's memory) or, with ``--stream``, to list its row groups and read them one at a
time. Paths may be local or pyarrow URIs, like ``--storage``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Optional

import pyarrow as pa
import torch

from .config import ConfigError


@dataclass(frozen=True)
class TableConfig:
    """A checked parquet data set: where, which columns, how many rows, the dims."""

    path: str
    features: tuple[str, ...]
    targets: tuple[str, ...]
    rows: int
    input_dim: int
    output_dim: int


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


def inspect_table(path: str, features: Optional[str], target: Optional[str]) -> TableConfig:
    """Check a parquet data set on the driver; raise ConfigError with one line if unusable."""
    ds = _dataset(path)
    try:
        schema = ds.schema
        rows = ds.count_rows()
    except (pa.ArrowInvalid, OSError) as err:
        raise ConfigError(f"--data {path} is not readable as parquet ({str(err).splitlines()[0]})") from None
    names = schema.names
    feats = _pick(names, features, r"f\d+", "features", path)
    targs = _pick(names, target, r"t\d+", "target", path)
    if rows == 0:
        raise ConfigError(f"--data {path} has no rows")
    return TableConfig(path, feats, targs, rows,
                       sum(_width(schema.field(c), path) for c in feats),
                       sum(_width(schema.field(c), path) for c in targs))


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


def load_table(table: TableConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """The whole data set as float32 tensors (inputs, targets), rows in file order."""
    data = _dataset(table.path).to_table(columns=list(table.features + table.targets))
    return _columns_to_tensor(data, table.features), _columns_to_tensor(data, table.targets)


def list_row_groups(table: TableConfig) -> list[tuple[str, int, int]]:
    """Every row group of the data set as (file, row group, rows), in file order: the
    units ``--stream`` shuffles and reads (metadata only, no rows are read)."""
    groups = []
    for fragment in sorted(_dataset(table.path).get_fragments(), key=lambda f: f.path):
        for piece in fragment.split_by_row_group():
            info = piece.row_groups[0]
            groups.append((fragment.path, info.id, info.num_rows))
    return [g for g in groups if g[2] > 0]


def row_group_reader(table: TableConfig):
    """read(file, row group) -> (inputs, targets) as float32 tensors, for --stream."""
    import pyarrow.parquet as pq

    from .storage import resolve_storage

    fs = resolve_storage(table.path).fs
    columns = list(dict.fromkeys(table.features + table.targets))

    def read(path: str, row_group: int) -> tuple[torch.Tensor, torch.Tensor]:
        with fs.open_input_file(path) as f:
            data = pq.ParquetFile(f).read_row_group(row_group, columns=columns)
        return _columns_to_tensor(data, table.features), _columns_to_tensor(data, table.targets)

    return read


def load_user_dataset(spec: str):
    """``package.module:callable`` returning a map-style Dataset of (input, target) pairs."""
    from .models import load_callable

    fn = load_callable(spec, what="dataset")
    try:
        ds = fn()
    except Exception as err:
        raise ConfigError(f"dataset '{spec}' raised {type(err).__name__}: {err}") from None
    if not hasattr(ds, "__getitem__") or not hasattr(ds, "__len__"):
        raise ConfigError(f"dataset '{spec}' returned {type(ds).__name__}, not a map-style Dataset "
                          "(it needs __len__ and __getitem__)")
    if len(ds) == 0:
        raise ConfigError(f"dataset '{spec}' is empty")
    item = ds[0]
    if not (isinstance(item, (tuple, list)) and len(item) == 2):
        raise ConfigError(f"dataset '{spec}' items must be (input, target) pairs")
    return ds


def write_synthetic(out: str, rows: int, features: int, targets: int, files: int = 1,
                    seed: int = 0, row_group_rows: int = 8192) -> list[str]:
    """A regression set labelled by a fixed random teacher network (a 2-layer MLP), so a
    model can really learn it. Columns: id, f0..f{F-1}, t0..t{T-1} (float32); row groups
    of ``row_group_rows`` rows (what --stream shuffles and reads one at a time)."""
    import pyarrow.parquet as pq

    from .storage import resolve_storage

    for name, value in (("rows", rows), ("features", features), ("targets", targets), ("files", files),
                        ("row-group-rows", row_group_rows)):
        if value <= 0:
            raise ConfigError(f"--{name} must be a positive integer, got {value}")
    if files > rows:
        raise ConfigError(f"--files {files} is more than --rows {rows}")
    g = torch.Generator().manual_seed(seed)
    hidden = max(16, features)
    w1 = torch.randn(features, hidden, generator=g) / features**0.5
    w2 = torch.randn(hidden, targets, generator=g) / hidden**0.5
    x = torch.randn(rows, features, generator=g)
    y = torch.tanh(x @ w1) @ w2 + 0.01 * torch.randn(rows, targets, generator=g)
    columns: dict[str, Any] = {"id": pa.array(range(rows), type=pa.int64())}
    columns.update({f"f{i}": pa.array(x[:, i].numpy()) for i in range(features)})
    columns.update({f"t{i}": pa.array(y[:, i].numpy()) for i in range(targets)})
    table = pa.table(columns)
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
