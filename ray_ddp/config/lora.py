"""--lora's spec, ``r=8,alpha=16,targets=q_proj,v_proj``, read into an AdapterConfig (no
torch, no peft: a mistake is one line before anything starts). Runs on the driver and on
workers; models/lora.py puts the adapters on the model.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from ray_ddp.errors import ConfigError

SPEC_EXAMPLE = "r=8,alpha=16,targets=q_proj,v_proj"


@dataclasses.dataclass(frozen=True)
class AdapterConfig:
    """What --lora asks for: rank ``r``, scale ``alpha`` (peft's lora_alpha), dropout on
    the adapters' input, and the layers that get them (None: peft's default for the
    architecture)."""

    r: int = 8
    alpha: int = 16
    dropout: float = 0.0
    targets: Optional[tuple[str, ...]] = None


def parse_lora(spec: str) -> AdapterConfig:
    """``r=8,alpha=16,targets=q_proj,v_proj`` -> AdapterConfig; a mistake is one line."""
    fields: dict[str, list[str]] = {}
    key = None
    for part in (p.strip() for p in spec.split(",") if p.strip()):  # "" alone: every default
        if "=" in part:
            key, value = (s.strip() for s in part.split("=", 1))
            if key not in ("r", "alpha", "dropout", "targets") or key in fields:
                raise ConfigError(f"--lora {spec}: {'repeated' if key in fields else 'unknown'} key "
                                  f"{key!r}; give r, alpha, dropout and targets, e.g. {SPEC_EXAMPLE}")
            fields[key] = [value] if value else []
        elif key == "targets":  # targets=q_proj,v_proj: the list goes on
            fields[key].append(part)
        else:
            raise ConfigError(f"--lora {spec}: {part!r} is not key=value; e.g. {SPEC_EXAMPLE}")
    try:
        cfg = AdapterConfig(r=int(_one(fields, "r", "8")), alpha=int(_one(fields, "alpha", "16")),
                            dropout=float(_one(fields, "dropout", "0")),
                            targets=tuple(fields["targets"]) if "targets" in fields else None)
    except ValueError:
        raise ConfigError(f"--lora {spec}: r and alpha are whole numbers, dropout a number; "
                          f"e.g. {SPEC_EXAMPLE}") from None
    if cfg.r < 1 or cfg.alpha < 1 or not 0 <= cfg.dropout < 1 or cfg.targets == ():
        raise ConfigError(f"--lora {spec}: r and alpha must be at least 1, dropout in [0, 1), "
                          f"targets not empty; e.g. {SPEC_EXAMPLE}")
    return cfg


def _one(fields: dict[str, list[str]], key: str, default: str) -> str:
    values = fields.get(key, [default])
    if len(values) != 1:
        raise ValueError(key)
    return values[0]
