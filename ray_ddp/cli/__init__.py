"""The command line: one module per command, each with ``add_parser`` and ``run``;
``main`` only registers them."""

from ray_ddp.cli.main import main

__all__ = ["main"]
