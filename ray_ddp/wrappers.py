"""What may wrap a user's model, told apart without importing what made it: peft's
adapters (--lora). Models, tasks, checkpoints and the FSDP units all look under them,
so this sits below all four. Runs on the driver and on workers.
"""

from __future__ import annotations

from typing import Any


def is_peft_model(model: Any) -> bool:
    """A peft PeftModel (told by its class, without importing peft)."""
    return any(c.__name__ == "PeftModel" and c.__module__.startswith("peft") for c in type(model).__mro__)


def unwrap_peft(model: Any) -> Any:
    """The model under a PeftModel's adapters (the one whose class and config say what
    its own loss is), or ``model`` itself."""
    return model.get_base_model() if is_peft_model(model) else model
