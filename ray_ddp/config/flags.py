"""The docs' flag table, generated from TrainConfig's fields (their help text is the
only copy). Runs on the driver and in scripts/regen_flag_table.py.
"""

from __future__ import annotations

import dataclasses
from ray_ddp.config.train import TrainConfig


def config_fields() -> list[dataclasses.Field]:
    """The fields in declaration order, for the CLI and the README table."""
    return list(dataclasses.fields(TrainConfig))


def render_flag_table() -> str:
    """The README's flag table, generated from the help texts above."""
    rows = ["| flag / YAML key | default | what it does |", "|---|---|---|"]
    for f in config_fields():
        flag = "--" + f.name.replace("_", "-")
        default = "" if f.default is None or f.default is False else f"`{f.default}`"
        rows.append(f"| `{flag}` / `{f.name}` | {default} | {f.metadata['help']} |")
    return "\n".join(rows)
