"""What `ray-ddp doctor` measures where a run would train: on each node (its GPUs and
their names, a matmul's FLOP/s per device, the run storage's write and read speed, the
settings NCCL reads) and in a process group of placed ranks (an all-reduce's bus
bandwidth, and how late each rank comes to it). Runs on the cluster's nodes, in the
``Probe`` actors cluster/doctor.py places (worker code: nothing here reads argv).
"""

from __future__ import annotations

import os
import socket
import statistics
import time
import uuid
from typing import Any, Optional

from ray_ddp.storage import resolve_storage

# A node started with this set (seconds) comes that late to each of the doctor's
# all-reduces: what one slow node does to a whole group, rehearsed without one
DELAY_ENV = "RAY_DDP_DOCTOR_DELAY_S"
# the settings that decide how NCCL and gloo talk between nodes
NETWORK_ENV = ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME", "NCCL_IB_HCA", "NCCL_IB_DISABLE", "NCCL_NET",
               "NCCL_P2P_DISABLE", "NCCL_DEBUG", "NCCL_ALGO", "NCCL_PROTO", "NCCL_CROSS_NIC",
               "NCCL_NET_GDR_LEVEL", "FI_PROVIDER", "FI_EFA_USE_DEVICE_RDMA")
IB_DEVICES = "/sys/class/infiniband"


def matmul_tflops(device, n: int, seconds: float = 0.5) -> float:
    """A square matmul's achieved TFLOP/s on ``device`` (bf16 on a GPU, fp32 on a CPU),
    repeated for about ``seconds`` after a warm-up."""
    import torch

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda *_: None)
    a @ b
    sync(device)
    reps, started = 0, time.perf_counter()
    while time.perf_counter() - started < seconds:
        a @ b
        reps += 1
        if reps % 8 == 0:
            sync(device)
    sync(device)
    return 2 * n**3 * reps / (time.perf_counter() - started) / 1e12


def storage_speed(storage: str, node_id: str, mb: int) -> dict[str, float]:
    """Write ``mb`` MB into the run storage from this node, read it back, delete it: MB/s."""
    store = resolve_storage(storage)
    path = f"{store.path.rstrip('/')}/.ray-ddp-doctor-{node_id[:12]}-{uuid.uuid4().hex[:8]}"
    data = os.urandom(mb * 2**20)
    store.fs.create_dir(store.path, recursive=True)
    try:
        started = time.perf_counter()
        with store.fs.open_output_stream(path) as f:
            f.write(data)
        wrote = time.perf_counter() - started
        started = time.perf_counter()
        with store.fs.open_input_stream(path) as f:
            back = f.read()
        read = time.perf_counter() - started
    finally:
        try:
            store.fs.delete_file(path)
        except OSError:
            pass
    if len(back) != len(data):
        raise OSError(f"read back {len(back)} of {len(data)} bytes")
    return {"write_mb_s": mb / wrote, "read_mb_s": mb / read}


class Probe:
    """A Ray actor on one node: measures the node, and joins process groups of probes."""

    def node_id(self) -> str:
        import ray

        return ray.get_runtime_context().get_node_id()

    def measure_node(self, storage: Optional[str], storage_mb: int, matmul_n: int) -> dict[str, Any]:
        import torch

        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        devices = [torch.device("cuda", i) for i in range(gpus)] or [torch.device("cpu")]
        found: dict[str, Any] = {
            "node_id": self.node_id(), "host": socket.gethostname(), "cpus": os.cpu_count(),
            "gpu_names": [torch.cuda.get_device_name(i) for i in range(gpus)],
            "matmul_tflops": [matmul_tflops(d, matmul_n) for d in devices],
            "env": {k: os.environ[k] for k in NETWORK_ENV if k in os.environ},
            "ib_devices": sorted(os.listdir(IB_DEVICES)) if os.path.isdir(IB_DEVICES) else [],
            "storage": None, "storage_error": None,
        }
        if storage:
            try:
                found["storage"] = storage_speed(storage, found["node_id"], storage_mb)
            except Exception as e:  # a node that cannot reach the storage: the finding itself
                found["storage_error"] = " ".join(f"{type(e).__name__}: {e}".split())[:300]
        return found

    def address(self) -> tuple[str, int]:
        """Where this probe, as rank 0, would serve a group's rendezvous."""
        import ray

        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return ray.util.get_node_ip_address(), port

    def all_reduce(self, rank: int, world: int, master: tuple[str, int], backend: str, mb: int,
                   iters: int, timeout_s: float) -> dict[str, Any]:
        """Join a group of ``world`` probes, time ``iters`` all-reduces of ``mb`` MB, leave.
        ``late_s``: how long after the group's start of an all-reduce this rank came to
        it (the median over the iterations), ``busbw_gb_s``: the bus bandwidth its own
        all-reduces gave (nccl-tests' measure: 2(n-1)/n x bytes / time)."""
        import datetime

        import torch
        import torch.distributed as dist

        dist.init_process_group(backend, init_method=f"tcp://{master[0]}:{master[1]}", rank=rank,
                                world_size=world, timeout=datetime.timedelta(seconds=timeout_s))
        try:
            device = torch.device("cuda", 0) if backend == "nccl" else torch.device("cpu")
            x = torch.ones(mb * 2**20 // 4, device=device)
            delay = float(os.environ.get(DELAY_ENV) or 0)
            sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
            for _ in range(2):
                dist.all_reduce(x)
            sync()
            late, took = [], []
            for _ in range(iters):
                dist.barrier()  # every rank starts each round together, give or take the barrier
                started = time.perf_counter()
                if delay:
                    time.sleep(delay)
                came = time.perf_counter()
                dist.all_reduce(x)
                sync()
                late.append(came - started)
                took.append(time.perf_counter() - came)
        finally:
            dist.destroy_process_group()
        step = statistics.median(took)
        return {"rank": rank, "node_id": self.node_id(), "late_s": statistics.median(late),
                "all_reduce_s": step, "busbw_gb_s": 2 * (world - 1) / world * mb * 2**20 / max(step, 1e-9) / 1e9}
