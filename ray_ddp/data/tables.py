"""Reading a parquet data set as tensors: the whole of it, or one row group at a time
for ``--stream``; each read checks its rows. Runs on workers.
"""

from __future__ import annotations

from typing import Optional
import pyarrow as pa
import pyarrow.compute as pc
import torch
from ray_ddp.errors import ConfigError
from ray_ddp.data.table_stats import CheckedTable, open_dataset
from ray_ddp.storage import resolve_storage


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


def load_table(table: CheckedTable, seq_len: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """The whole data set as tensors (inputs, targets), rows in file order: float32
    inputs and targets for regression, int64 labels for classification, and for a
    language model int64 tokens, each row's first ``seq_len`` as inputs and the same
    shifted by one as targets."""
    data = open_dataset(table.path).to_table(columns=list(dict.fromkeys(table.features + table.targets)))
    return table_tensors(data, table, seq_len, f"--data {table.path}")


def table_tensors(data: pa.Table, table: CheckedTable, seq_len: int,
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


def list_row_groups(table: CheckedTable) -> list[tuple[str, int, int]]:
    """Every row group of the data set as (file, row group, rows), in file order: the
    units ``--stream`` shuffles and reads (metadata only, no rows are read)."""
    groups = []
    for fragment in sorted(open_dataset(table.path).get_fragments(), key=lambda f: f.path):
        for piece in fragment.split_by_row_group():
            info = piece.row_groups[0]
            groups.append((fragment.path, info.id, info.num_rows))
    return [g for g in groups if g[2] > 0]


def row_group_reader(table: CheckedTable, seq_len: int = 0):
    """read(file, row group) -> (inputs, targets) as float32 tensors, for --stream."""
    import pyarrow.parquet as pq

    fs = resolve_storage(table.path).fs
    columns = list(dict.fromkeys(table.features + table.targets))

    def read(path: str, row_group: int) -> tuple[torch.Tensor, torch.Tensor]:
        with fs.open_input_file(path) as f:
            data = pq.ParquetFile(f).read_row_group(row_group, columns=columns)
        return table_tensors(data, table, seq_len, f"{path} row group {row_group}")

    return read
