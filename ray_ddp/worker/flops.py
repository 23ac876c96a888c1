"""Model FLOPs utilisation (``mfu`` in the metrics): how much of the devices' peak the
model's own arithmetic uses. Runs on workers.

    mfu = flops_per_token x tokens_per_s / peak
    flops_per_token = 6 x N     (N: the model's parameters; forward 2N, backward 4N per
                                 token, the attention scores left out: PaLM's appendix B)
    peak = the dense bf16 tensor-core peak of the worker's GPUs (PEAK_TFLOPS), summed
           over the distinct GPUs a worker owns (a two-stage model: two)

For token tasks (language models, HF rows with input_ids) on GPUs this table names;
null on CPU, for other tasks, and on a GPU not in the table. The peak is bf16's whatever
the run's precision: fp32 runs show how far they are from it.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

# Dense (no sparsity) bf16 tensor-core peaks, TFLOP/s, from the vendors' data sheets (SXM
# parts where there are several); matched against torch.cuda.get_device_name.
PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "GH200": 989.0, "B200": 2250.0, "A100": 312.0,
               "L40S": 362.0, "L40": 181.0, "A10G": 70.0, "A10": 125.0, "L4": 121.0, "V100": 125.0}


def flops_per_token(model: nn.Module) -> float:
    """6 x the model's parameters (a sharded model's DTensors count whole)."""
    return 6.0 * sum(p.numel() for p in model.parameters())


def peak_flops(devices: list[torch.device]) -> Optional[float]:
    """The summed bf16 peak of the distinct GPUs in ``devices``, in FLOP/s; None on CPU
    or for a GPU PEAK_TFLOPS does not name."""
    gpus = {d for d in devices if d.type == "cuda"}
    if not gpus or len(gpus) != len(set(devices)):
        return None
    total = 0.0
    for device in gpus:
        name = torch.cuda.get_device_name(device)
        # the longest key that the name holds: "H100" before "H10", "A100" before "A10"
        match = max((k for k in PEAK_TFLOPS if k in name), key=len, default=None)
        if match is None:
            return None
        total += PEAK_TFLOPS[match] * 1e12
    return total


def model_flops_utilization(tokens_per_s: Optional[float], per_token: float,
                            peak: Optional[float]) -> Optional[float]:
    if not tokens_per_s or peak is None:
        return None
    return per_token * tokens_per_s / peak
