"""``ray-ddp data synth``: parquet data sets a model can really learn (regression from
a teacher, classes from blobs, Markov token sequences). Runs on the driver.
"""

from __future__ import annotations

from typing import Any
import pyarrow as pa
import torch
from ray_ddp.errors import ConfigError
from ray_ddp.storage import resolve_storage


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
