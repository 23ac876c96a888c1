"""Tabular classification on real data: scikit-learn's breast cancer set (569 rows, 30
numeric features, 2 classes; it ships inside the package), written to parquet and trained
through the command line with the built-in mlp, validated on a held-out fifth.

    pip install -e ".[examples]"
    python examples/tabular_classification.py [--workers 2] [--epochs 20] [--storage ~/ray_ddp_runs]
"""

import argparse
import os
import subprocess
import sys
import tempfile


def write_parquet(path: str) -> None:
    """Features standardized (mean 0, variance 1), columns f0..f29, the label as t0 (int64):
    the names `ray-ddp train` picks by default."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from sklearn.datasets import load_breast_cancer

    data = load_breast_cancer()
    x = (data.data - data.data.mean(axis=0)) / data.data.std(axis=0)
    columns = {f"f{i}": pa.array(x[:, i].astype("float32")) for i in range(x.shape[1])}
    columns["t0"] = pa.array(data.target.astype("int64"))
    pq.write_table(pa.table(columns), path)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--storage", default="~/ray_ddp_runs")
    parser.add_argument("--name", default="breast-cancer")
    args = parser.parse_args()
    path = os.path.join(tempfile.mkdtemp(prefix="ray_ddp_tabular_"), "breast_cancer.parquet")
    write_parquet(path)
    cmd = [sys.executable, "-m", "ray_ddp", "train", "--data", path, "--model", "mlp", "--width", "64",
           "--depth", "2", "--batch-size", "32", "--optimizer", "adamw", "--lr", "0.003",
           "--val-fraction", "0.2", "--epochs", str(args.epochs), "--workers", str(args.workers),
           "--storage", args.storage, "--name", args.name]
    print("$", " ".join(cmd), flush=True)
    raise SystemExit(subprocess.call(cmd))


if __name__ == "__main__":
    main()
