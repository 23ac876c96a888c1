"""A worker's devices, from its session (Ray's GPUs), and its peak memory. Runs on workers."""

from __future__ import annotations

import resource

import torch

from ray_ddp.plan import RunPlan


def worker_devices(run: RunPlan, session) -> list[torch.device]:
    """This worker's devices, from Ray (the GPUs the plan gave each worker); a two-stage
    model on one device uses it twice."""
    devices = session.gpus() if run.gpus_per_worker else [torch.device("cpu")]
    if devices[0].type == "cuda":
        torch.cuda.set_device(devices[0])  # collectives of this process use this GPU
    if run.config.model == "toy-mp" and len(devices) == 1:
        devices = devices * 2
    return devices


def peak_memory_mb(device: torch.device) -> dict:
    """This process's peak host memory (RSS; Linux counts KiB) and, on a GPU, the peak
    memory torch allocated there."""
    out = {"max_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
    if device.type == "cuda":
        out["gpu_max_mb"] = torch.cuda.max_memory_allocated(device) / 2**20
    return out
