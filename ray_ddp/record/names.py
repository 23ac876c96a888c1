"""The names in a run folder's checkpoints: a checkpoint folder's (``step-00000800``) and
the files it may hold. No torch and no pyarrow here: Ray Train's controller (the metrics
callback, which keeps and prunes checkpoints) names them too, and never imports torch.
Runs on workers, in Ray Train's controller and on the driver.
"""

from __future__ import annotations

import re
from typing import Optional

MODEL_FILE = "model.pt"


STATE_FILE = "train_state.pt"


META_FILE = "meta.json"


HF_CONFIG_FILE = "hf_config.json"


# The options of a checkpoint's run that must match for a resume to load its weights:
# the model's shape and the strategy that wrote it (driver/start.py checks them against
# the checkpoint header's config and plan, checkpoint/format.py's).
RESUME_KEYS = ("model", "task", "input_dim", "output_dim", "width", "depth", "heads", "seq_len",
               "vocab_size", "strategy", "lora")


# Every file a checkpoint folder may hold besides meta.json: the two writers' files and
# DCP's shards (rank r's __r_<i>.distcp, the coordinator's .metadata), and in a sharded
# run's in-memory snapshot, rank r's shards (rank-<r>.pt). A manifest is read
# from storage, which others may write: a name outside this list (../../x, /etc/x, a
# name with a separator) makes the checkpoint unusable before any byte is read or written.
CHECKPOINT_FILES = re.compile(r"model\.pt|train_state\.pt|hf_config\.json|\.metadata|__\d+_\d+\.distcp|rank-\d+\.pt")


def unexpected_file(names) -> Optional[str]:
    """The first name in a manifest that a checkpoint never holds, or None."""
    return next((name for name in names if not (isinstance(name, str) and CHECKPOINT_FILES.fullmatch(name))),
                None)


def checkpoint_dir_name(step: int) -> str:
    return f"step-{step:08d}"


def checkpoint_step(name: Optional[str]) -> int:
    """The step of a checkpoint folder's name (step-00000800 -> 800); 0 for none."""
    found = re.search(r"step-(\d+)", name or "")
    return int(found[1]) if found else 0
