"""``ray-ddp demo basic|checkpoint|model-parallel``: the PyTorch DDP tutorial's demos. Runs on the driver."""

from __future__ import annotations

import argparse
import sys

from ray_ddp.cli.common import EXIT_TRAINING_FAILED
from ray_ddp.config.choices import DEMOS
from ray_ddp.config.train import TrainConfig
from ray_ddp.errors import TrainingError


def add_parser(sub) -> None:
    demo = sub.add_parser("demo", help="run one of the PyTorch DDP tutorial's demos")
    demo.add_argument("which", choices=DEMOS, help="which demo")
    demo.add_argument("--workers", type=int, default=None, help="training workers (default: 2 on CPU)")
    demo.add_argument("--storage", default=TrainConfig.storage,
                      help=f"where the demo's runs live (default: {TrainConfig.storage})")


def run(args: argparse.Namespace) -> int:
    # here, not at the top: `ray-ddp --help` imports every command's module and needs none of what this one runs
    from ray_ddp.driver.demos import DemoFailed, run_demo

    try:
        result = run_demo(args.which, workers=args.workers, storage=args.storage)
    except (TrainingError, DemoFailed) as err:
        print(f"ray-ddp demo {args.which}: FAILED: {err}", file=sys.stderr)
        return EXIT_TRAINING_FAILED
    print(f"demo {args.which}: OK: {result.detail}")
    return 0
