"""A byte-level language model on real text: the gpt model on Python's own help topics
(`pydoc_data.topics`, about 460 kB of English that ships with every CPython; nothing is
downloaded), written as .txt files and trained through the command line, validated on
held-out text every epoch; the script then compares the validation perplexity with a
byte-frequency (unigram) model of the same text.

    python examples/text_gpt.py [--workers 2] [--epochs 3] [--storage ~/ray_ddp_runs]
"""

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
from collections import Counter


def write_corpus(folder: str) -> tuple[bytes, bytes]:
    import pydoc_data.topics

    text = "".join(pydoc_data.topics.topics.values()).encode()
    cut = int(len(text) * 0.9)
    os.makedirs(os.path.join(folder, "train"), exist_ok=True)
    with open(os.path.join(folder, "train", "topics.txt"), "wb") as f:
        f.write(text[:cut])
    with open(os.path.join(folder, "val.txt"), "wb") as f:
        f.write(text[cut:])
    return text[:cut], text[cut:]


def unigram_perplexity(train: bytes, val: bytes) -> float:
    counts = Counter(train)
    total = len(train) + 256  # add-one smoothing
    return math.exp(-sum(math.log((counts[b] + 1) / total) for b in val) / len(val))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--storage", default="~/ray_ddp_runs")
    parser.add_argument("--name", default="text-gpt")
    args = parser.parse_args()
    folder = tempfile.mkdtemp(prefix="ray_ddp_text_")
    train, val = write_corpus(folder)
    cmd = [sys.executable, "-m", "ray_ddp", "train", "--data", os.path.join(folder, "train"),
           "--val-data", os.path.join(folder, "val.txt"), "--model", "gpt", "--width", "128",
           "--depth", "3", "--heads", "4", "--seq-len", "64", "--batch-size", "32", "--optimizer",
           "adamw", "--lr", "0.003", "--warmup-steps", "50", "--schedule", "cosine", "--clip-grad", "1.0",
           "--report-every", "50", "--epochs", str(args.epochs), "--workers", str(args.workers),
           "--storage", args.storage, "--name", args.name, "--json"]
    print("$", " ".join(cmd), flush=True)
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True)
    print(proc.stdout, end="")
    if proc.returncode != 0:
        raise SystemExit(proc.returncode)
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    print(f"validation perplexity {summary['val_perplexity']:.2f} vs {unigram_perplexity(train, val):.2f} "
          f"for a byte-frequency model of the same text")


if __name__ == "__main__":
    main()
