"""Where the workers go: how many, how many GPUs and CPUs each, which backend, from
the cluster's GPUs and the model's stages. Runs on the driver.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence
from ray_ddp.errors import ConfigError


DEFAULT_CPU_WORKERS = 2


CPUS_PER_WORKER = 1


@dataclass(frozen=True)
class Placement:
    """What the job asks Ray for: ``workers`` actors, each with these resources; an
    elastic run (``min_workers`` < ``workers``) starts with as many as fit, at least
    ``min_workers``."""

    workers: int
    gpus_per_worker: int
    cpus_per_worker: int
    backend: str
    min_workers: Optional[int] = None

    @property
    def elastic(self) -> bool:
        return self.min_workers is not None and self.min_workers < self.workers

    @property
    def needed(self) -> int:
        """Workers the run cannot start without (the preflight counts these)."""
        return self.min_workers if self.elastic else self.workers

    def num_workers(self):
        """ScalingConfig's num_workers: N, or (MIN, MAX) for Ray's elastic policy."""
        return (self.min_workers, self.workers) if self.elastic else self.workers

    @property
    def use_gpu(self) -> bool:
        return self.gpus_per_worker > 0

    def resources_per_worker(self) -> dict[str, float]:
        res = {"CPU": float(self.cpus_per_worker)}
        if self.use_gpu:
            res["GPU"] = float(self.gpus_per_worker)
        return res

    def describe(self) -> str:
        each = f"{self.gpus_per_worker} GPU" if self.use_gpu else f"{self.cpus_per_worker} CPU"
        count = f"{self.min_workers}-{self.workers}" if self.elastic else str(self.workers)
        return f"{count} workers x {each}, backend {self.backend}"


def plan_placement(
    workers: Optional[int],
    gpus_per_worker: Optional[int],
    backend: Optional[str],
    node_gpus: Sequence[int],
    stages: int = 1,
    cpus_per_worker: Optional[int] = None,
    local_cpus: Optional[int] = None,
    min_workers: Optional[int] = None,
) -> Placement:
    """Fill in the defaults from the GPUs of each node (``node_gpus``) and check the pairs fit.

    - gpus_per_worker defaults to 0 on a cluster without GPUs, else to one GPU per model
      stage (a pair for the two-stage toy-mp where a node has two), else 1;
    - cpus_per_worker defaults, for CPU workers on a Ray this run started itself
      (``local_cpus``: its CPUs), to an equal share of them; anywhere else to 1;
    - more GPUs per worker than the model has stages is refused;
    - workers defaults to how many whole slots of gpus_per_worker GPUs the nodes hold
      (a pair never straddles two nodes), or 2 on CPU;
    - backend defaults to nccl on GPU, gloo on CPU;
    - an elastic run (``min_workers`` below ``workers``, its MAX) plans for MAX workers.
    """
    total_gpus = sum(node_gpus)
    if gpus_per_worker is not None:
        gpw = gpus_per_worker
    elif total_gpus == 0:
        gpw = 0
    else:
        gpw = min(stages, max(node_gpus))
    if gpw > stages:
        # a pair for a one-stage model would leave its second GPU idle and put the targets
        # on it while the outputs stay on the first
        raise ConfigError(
            f"--gpus-per-worker {gpw} gives each worker a GPU per model stage, and this model has "
            f"{stages} stage; use --gpus-per-worker 1 (a pair is for the two-stage toy-mp)"
        )
    if workers is None:
        if gpw == 0:
            workers = DEFAULT_CPU_WORKERS
        else:
            workers = sum(g // gpw for g in node_gpus)
            if workers == 0:
                raise ConfigError(
                    f"--gpus-per-worker {gpw} needs a node with {gpw} GPUs; the cluster has "
                    f"{_describe_gpus(node_gpus)}; pass --gpus-per-worker 0 to train on CPU"
                )
    if backend is None:
        backend = "nccl" if gpw > 0 else "gloo"
    if backend == "nccl" and gpw == 0:
        raise ConfigError("--backend nccl needs GPUs; use --backend gloo with --gpus-per-worker 0")
    if cpus_per_worker is None:
        # Ray starts a 1-CPU worker with OMP_NUM_THREADS=1, so one CPU worker alone on a
        # many-core machine would use one core; a Ray of our own is ours to fill.
        cpus_per_worker = max(1, local_cpus // workers) if gpw == 0 and local_cpus else CPUS_PER_WORKER
    return Placement(workers=workers, gpus_per_worker=gpw, cpus_per_worker=cpus_per_worker,
                           backend=backend, min_workers=min_workers if min_workers != workers else None)


def _describe_gpus(node_gpus: Sequence[int]) -> str:
    if not any(node_gpus):
        return "0 GPU"
    return f"{sum(node_gpus)} GPU on nodes of " + ", ".join(str(g) for g in node_gpus if g)
