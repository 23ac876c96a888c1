"""``ray-ddp data synth``: write a parquet data set a model can learn. Runs on the driver."""

from __future__ import annotations

import argparse

from ray_ddp.cli.common import Parser


def add_parser(sub) -> None:
    data = sub.add_parser("data", help="data set tools")
    data_sub = data.add_subparsers(dest="data_command", required=True, parser_class=Parser)
    synth = data_sub.add_parser("synth", help="write a parquet set a model can learn: regression or "
                                              "classification by a fixed random teacher network, "
                                              "or token sequences of a fixed Markov chain (lm)")
    synth.add_argument("--task", choices=("regression", "classification", "lm"), default="regression",
                       help="what the set is for (default: regression)")
    synth.add_argument("--classes", type=int, default=10,
                       help="classes of a classification set: label column t0 (default: 10)")
    synth.add_argument("--seq-len", type=int, default=64,
                       help="an lm set's sequences hold seq-len + 1 tokens (default: 64)")
    synth.add_argument("--vocab-size", type=int, default=256, help="an lm set's tokens (default: 256)")
    synth.add_argument("--rows", type=int, required=True, help="rows to write")
    synth.add_argument("--features", type=int, default=10, help="feature columns f0.. (default: 10)")
    synth.add_argument("--targets", type=int, default=5, help="target columns t0.. (default: 5)")
    synth.add_argument("--out", required=True,
                       help="a folder (or a .parquet file with --files 1); local path or URI")
    synth.add_argument("--files", type=int, default=1, help="parquet files to split into (default: 1)")
    synth.add_argument("--seed", type=int, default=0, help="seed of the teacher and rows (default: 0)")
    synth.add_argument("--row-group-rows", type=int, default=8192,
                       help="rows per parquet row group, the unit --stream reads (default: 8192)")


def run(args: argparse.Namespace) -> int:
    # here, not at the top: `ray-ddp --help` imports every command's module and needs none of what this one runs
    from ray_ddp.data.synth_files import write_synthetic

    paths = write_synthetic(args.out, args.rows, args.features, args.targets, args.files, args.seed,
                            args.row_group_rows, task=args.task, classes=args.classes,
                            seq_len=args.seq_len, vocab_size=args.vocab_size)
    what = {"regression": f"{args.features} features, {args.targets} targets",
            "classification": f"{args.features} features, a label of {args.classes} classes",
            "lm": f"sequences of {args.seq_len + 1} tokens of {args.vocab_size}"}[args.task]
    print(f"wrote {args.rows} rows ({what}) to {len(paths)} parquet file(s) under {args.out}")
    return 0
