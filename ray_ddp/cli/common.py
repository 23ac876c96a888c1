"""What every command shares: exit codes, a parser whose errors are one line, how flags
and ``--config`` become a TrainConfig, and number formatting. Runs on the driver."""

from __future__ import annotations

import argparse
from typing import Any

from ray_ddp.config.flags import config_fields
from ray_ddp.config.train import TrainConfig

EXIT_TRAINING_FAILED = 1
EXIT_USER_ERROR = 2
EXIT_INTERRUPTED = 130


class Parser(argparse.ArgumentParser):
    """argparse, but a bad flag is one line, not a usage dump."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(EXIT_USER_ERROR, f"{self.prog}: error: {message}; see {self.prog} --help\n")


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    """Flags that were given, over the YAML file's keys, over the defaults."""
    given = {f.name: getattr(args, f.name) for f in config_fields()
             if getattr(args, f.name) is not None}
    if args.config:
        return TrainConfig.from_yaml(args.config, overrides=given)
    return TrainConfig.from_dict(given)


def fmt(value: Any, spec: str = ".4f") -> str:
    return "n/a" if value is None else format(value, spec)
