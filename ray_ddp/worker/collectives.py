"""What the process group itself knows of a hang, and how long it lets a collective
wait. Runs on workers.

PyTorch's flight recorder (``TORCH_FR_BUFFER_SIZE``, which cluster/runtime_env.py sets
when the hang watch is on) keeps each rank's last collectives: which it enqueued, which
started and which completed, with their sizes and the timeout each ran under. When the
watch asks a hung run for its stacks, the heartbeat also dumps the recorder, so
``<run>/hangs/<step>/`` holds not only where each rank's Python is but how far each rank
got in the collectives: the rank whose last enqueued collective is behind its peers' is
the one they wait for.

The process group starts with a timeout longer than the watch's patience for a first step
(``start_up_timeout_s``: at least Ray Train's 30 min, as the first collective waits for the
slowest rank's start-up, a model copied to its node, a first compile). After a worker's
first step ``shorten_collective_timeout`` lowers it to the longest the watch then ever
waits (a meant wait's --wait-timeout, by default MEANT_WAIT_FACTOR x --hang-timeout) plus one more --hang-timeout: the
watch acts first, and a hang it cannot act on (its driver gone) is still bounded.

Both go through torch's private names (the dump's, and ``_set_pg_timeout``), here alone, checked against torch CHECKED_TORCH
(tests/unit/test_collectives.py pins them): on a torch that moved one, the run loses the
dump or the shorter timeout, never its training.
"""

from __future__ import annotations

import datetime
import json
from typing import Optional

CHECKED_TORCH = "2.13"

# A rank in a meant wait (a checkpoint's upload, FSDP's gathers: worker/heartbeat.py's
# meant_wait) is hung only after this many times --hang-timeout (driver/hangs.py): a slow
# upload is not a hang, one that never ends still is. The process group waits longer.
MEANT_WAIT_FACTOR = 10

# Ray Train's TorchConfig timeout: the start-up's floor
START_UP_TIMEOUT_S = 1800.0


def meant_wait_patience_s(hang_timeout: float, wait_timeout: Optional[float] = None) -> float:
    """How long the watch lets a rank be in a meant wait: ``--wait-timeout``, by default
    MEANT_WAIT_FACTOR x --hang-timeout."""
    return wait_timeout if wait_timeout is not None else MEANT_WAIT_FACTOR * hang_timeout


def first_step_patience_s(hang_timeout: float, wait_timeout: Optional[float] = None) -> float:
    """How long the watch lets a group be in its first step (a first compile, a resumed
    Ray Data stream skipping to its step, the first collective waiting for the slowest
    start): ``--wait-timeout`` when given, else a meant wait's patience and never less
    than the start-up's 30 min."""
    if wait_timeout is not None:
        return wait_timeout
    return max(START_UP_TIMEOUT_S, meant_wait_patience_s(hang_timeout))


def start_up_timeout_s(hang_timeout: float, wait_timeout: Optional[float] = None) -> float:
    """The process group's timeout until a worker's first step: longer than the watch's
    patience for that step and its handling (stacks, py-spy, the kills), so the watch acts
    first; Ray Train's 30 min without a watch."""
    if hang_timeout <= 0:
        return START_UP_TIMEOUT_S
    return first_step_patience_s(hang_timeout, wait_timeout) + hang_timeout + 120


def collective_timeout_s(hang_timeout: float, wait_timeout: Optional[float] = None) -> Optional[float]:
    """The process group's timeout after the first step under ``--hang-timeout`` (the
    watch's longest patience, a meant wait's, and one more timeout), or None: no watch,
    the start-up one stays."""
    if hang_timeout <= 0:
        return None
    return meant_wait_patience_s(hang_timeout, wait_timeout) + hang_timeout


def shorten_collective_timeout(hang_timeout: float, wait_timeout: Optional[float] = None) -> Optional[float]:
    """Lower the default process group's timeout for every later collective (every rank
    calls it after its first step); the seconds set, or None where nothing changed."""
    import torch.distributed as dist

    seconds = collective_timeout_s(hang_timeout, wait_timeout)
    if seconds is None or not dist.is_initialized():
        return None
    try:
        from torch.distributed.distributed_c10d import _set_pg_timeout

        _set_pg_timeout(datetime.timedelta(seconds=seconds))
    except Exception:  # a moved name or a backend that cannot: the start-up timeout stays
        return None
    return seconds


def dump_collectives() -> Optional[str]:
    """This process's flight recorder as JSON text: every recorded collective and each
    process group's last enqueued, started and completed one. None where it recorded
    nothing (the recorder off) or cannot be read. NCCL keeps its own recorder (read by
    ``_dump_nccl_trace_json``, in CUDA builds of torch only); gloo's is the generic one."""
    try:
        import torch.distributed as dist
        from torch._C import _distributed_c10d as c10d

        nccl = dist.is_initialized() and dist.get_backend() == "nccl" and hasattr(c10d, "_dump_nccl_trace_json")
        text = (c10d._dump_nccl_trace_json if nccl else c10d._dump_fr_trace_json)(True, False)
        text = text.decode() if isinstance(text, bytes) else str(text)
        return text if json.loads(text).get("entries") else None
    except Exception:  # the dump is evidence, never a reason to fail the hang's handling
        return None


def describe_collectives(trace: str) -> str:
    """One line per process group of a dump: how far this rank got, e.g. 'process group
    0: collective 57 enqueued, 56 completed, 57 (gloo:all_reduce) not done'."""
    data = json.loads(trace)
    last_op = {}
    for entry in data.get("entries", []):
        last_op[(str(entry.get("pg_id")), int(entry.get("collective_seq_id", 0)))] = entry.get("profiling_name", "?")
    lines = []
    for pg, status in sorted(data.get("pg_status", {}).items()):
        enqueued = int(status.get("last_enqueued_collective", -1))
        completed = int(status.get("last_completed_collective", -1))
        line = f"process group {pg}: collective {enqueued} enqueued, {completed} completed"
        if enqueued > completed:
            line += f", {enqueued} ({last_op.get((pg, enqueued), '?')}) not done"
        lines.append(line)
    return "\n".join(lines)
