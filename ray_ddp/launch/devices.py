"""``ray_ddp.device()`` / ``devices()``: the devices a spawned process owns. Runs in the
user's processes.
"""

from __future__ import annotations

import os
from typing import Mapping
import torch
from ray_ddp.launch.env import PROCESS_DEVICES_ENV


def device(index: int = 0) -> torch.device:
    """This process's device: its (first, or ``index``-th) GPU, else the CPU."""
    own = devices()
    return own[index] if own[0].type == "cuda" else own[0]


def devices() -> list[torch.device]:
    """All GPUs Ray gave this process (two for gpus_per_process=2), or [cpu]."""
    return select_devices(os.environ, torch.cuda.is_available())


def select_devices(env: Mapping[str, str], cuda_available: bool) -> list[torch.device]:
    """The devices a process with environment ``env`` owns: the GPUs its launcher named in
    PROCESS_DEVICES_ENV (indices into CUDA_VISIBLE_DEVICES), or [cpu] if it named none or
    there is no CUDA. Outside spawn/launch (no such variable), every visible GPU."""
    if not cuda_available:
        return [torch.device("cpu")]
    if PROCESS_DEVICES_ENV not in env:
        return [torch.device(f"cuda:{i}") for i in range(torch.cuda.device_count())]
    own = [torch.device(f"cuda:{i}") for i in env[PROCESS_DEVICES_ENV].split(",") if i]
    return own or [torch.device("cpu")]
