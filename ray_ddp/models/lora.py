"""--lora: LoRA adapters (``peft``) on the model, so that only they train. Runs on the
driver (the spec checked, the adapters put on the meta-device model, so a target that
matches no layer is one line before Ray starts) and on workers (the same adapters on the
real model, before the strategy wraps it).

The spec (config/lora.py) is ``r=8,alpha=16,targets=q_proj,v_proj``: ``targets`` are
the names of the layers that get adapters (the end of a module's path, as peft matches
them); without it peft picks the usual ones for a known architecture. The base
weights are frozen: the optimizer, DDP's all-reduce and FSDP's gradients see the
adapters only. Checkpoints hold the whole model, base and adapters (a resume is exact);
``ray-ddp export --format hf`` writes the adapters as ``PeftModel.from_pretrained``
loads them.
"""

from __future__ import annotations

from typing import Any

from ray_ddp.config.lora import parse_lora
from ray_ddp.errors import ConfigError


def import_peft() -> Any:
    try:
        import peft  # not at the top: an optional extra, needed only with --lora
    except ImportError:
        raise ConfigError("--lora needs the peft package, which is not installed: "
                          "pip install 'ray_ddp[hf]' (or pip install peft)") from None
    return peft


def apply_lora(model: Any, spec: str, what: str) -> Any:
    """The model with LoRA adapters on its target layers, the rest frozen (peft's
    get_peft_model, which changes ``model`` in place and wraps it)."""
    adapters = parse_lora(spec)
    peft = import_peft()
    config = peft.LoraConfig(r=adapters.r, lora_alpha=adapters.alpha, lora_dropout=adapters.dropout,
                             target_modules=list(adapters.targets) if adapters.targets else None)
    try:
        return peft.get_peft_model(model, config)
    except ValueError as err:  # targets that match no layer, no default for this architecture
        reason = " ".join(str(err).split())
        if len(reason) > 240:
            reason = reason[:240] + "..."
        raise ConfigError(f"--lora {spec} does not fit {what}: {reason}; name the layers to adapt "
                          f"with targets=NAME,NAME (the end of their module path)") from None
