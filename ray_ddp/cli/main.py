"""The ``ray-ddp`` command line: each command's module (cli/<command>.py) adds its own
parser and runs it; ``main`` only registers them and turns a user's mistake into one
line and exit 2, a failed run into exit 1. Runs on the driver."""

from __future__ import annotations

import os
import sys
from typing import Optional, Sequence

from ray_ddp.cli import data, demo, doctor, export, launch, report, runs, train, tune
from ray_ddp.cli.common import EXIT_INTERRUPTED, EXIT_TRAINING_FAILED, EXIT_USER_ERROR, Parser
from ray_ddp.errors import ConfigError, StorageError

# in the order `ray-ddp --help` lists them
COMMANDS = {"train": train, "demo": demo, "launch": launch, "data": data, "runs": runs, "report": report,
            "export": export, "tune": tune, "doctor": doctor}


def build_parser() -> Parser:
    parser = Parser(prog="ray-ddp", description="PyTorch DDP training on a Ray cluster.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=Parser)
    for command in COMMANDS.values():
        command.add_parser(sub)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    # Like `python -m`, let --model mypkg.mod:fn import from the current folder.
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    args = build_parser().parse_args(argv)
    try:
        return COMMANDS[args.command].run(args)
    except ConfigError as err:
        print(f"ray-ddp {args.command}: error: {err}", file=sys.stderr)
        return EXIT_USER_ERROR
    except StorageError as err:
        print(f"ray-ddp {args.command}: storage error: {err}", file=sys.stderr)
        return EXIT_TRAINING_FAILED
    except KeyboardInterrupt:
        print("ray-ddp: interrupted; run the same command again to resume from the latest "
              "checkpoint", file=sys.stderr)
        return EXIT_INTERRUPTED
