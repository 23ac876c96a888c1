"""``ray-ddp export``: a checkpoint's model as one plain state_dict file. Runs on the driver."""

from __future__ import annotations

import argparse

from ray_ddp.config.train import TrainConfig


def add_parser(sub) -> None:
    export = sub.add_parser("export", help="write a checkpoint's model as one plain state_dict file "
                                           "(consolidating an FSDP checkpoint's shards)")
    export.add_argument("run", help="the run's name (its folder under --storage)")
    export.add_argument("--storage", default=TrainConfig.storage,
                        help=f"where the run lives (default: {TrainConfig.storage})")
    export.add_argument("--step", type=int, default=None,
                        help="the checkpoint's global step (default: the newest whole checkpoint)")
    export.add_argument("--out", metavar="FILE", default=None,
                        help="the file to write (default: <run>-step-<N>.pt in the current folder)")


def run(args: argparse.Namespace) -> int:
    from ray_ddp.checkpoint.export import export_model

    print(export_model(args.run, args.storage, args.step, args.out).text())
    return 0
