"""Heartbeat: how a worker tells the driver's hang watch (driver/hangs.py) that it is
still making progress, and how it answers when the watch asks for its stacks. Runs on
workers.

The training loop only counts: ``tick()`` after every step, validation batch and
checkpoint. A daemon thread sends the count to the watch actor every few seconds, so the
loop never waits on the network. The thread keeps running while the main thread is
stuck (a sleep, a collective, a CUDA sync all release the GIL), which is what lets a
hung rank still say where it is: when the watch asks, the thread writes down every
thread's Python stack (py-spy's view too, where py-spy can attach) and whether the main
thread is waiting in a collective or somewhere of its own.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import threading
import time
import traceback
from contextlib import contextmanager
from typing import Any, Iterator, Optional

from ray_ddp.worker.collectives import dump_collectives

# Where a rank that waits for its peers sits: torch.distributed's collectives (and FSDP),
# DDP's reducer (autograd's backward waits for the gradient all-reduce), and Ray Train's
# report barrier. The innermost frame outside the standard library decides.
_COLLECTIVE_PATHS = ("/torch/distributed/", "/torch/autograd/", "/torch/nn/parallel/", "/ray/")
_STDLIB = sysconfig.get_paths()["stdlib"]


class Heartbeat:
    """This rank's progress count and the thread that reports it; with no watch
    (``--hang-timeout 0``) ``tick`` and ``pause`` cost nothing and no thread runs."""

    def __init__(self, watch: Any, rank: int, node_id: str, ip: str, interval_s: float, step: int = 0,
                 group: Optional[int] = None):
        self.watch, self.rank, self.node_id, self.ip, self.interval_s = watch, rank, node_id, ip, interval_s
        self.group = group  # the id this worker group's ranks agreed on (group_id)
        # ``step``: the last step finished before this life (a resumed run's checkpoint's)
        self.progress, self.step, self.paused, self.waiting = 0, step, False, False
        # the training loop's thread (Ray Train runs it apart from the process's main thread)
        self._main = threading.get_ident()
        self._stop = threading.Event()
        if watch is not None:
            threading.Thread(target=self._run, name="ray_ddp-heartbeat", daemon=True).start()

    def tick(self, step: Optional[int] = None) -> None:
        self.progress += 1
        if step is not None:
            self.step = step

    @contextmanager
    def pause(self) -> Iterator[None]:
        """A wait that is meant (a preemption's deadline): not a hang."""
        self.paused = True
        try:
            yield
        finally:
            self.paused = False

    @contextmanager
    def meant_wait(self) -> Iterator[None]:
        """A wait that is the run's own work, however long it takes on a slow disk or
        link: a checkpoint's snapshot and the wait for the previous upload, the epoch's
        weight hash (FSDP gathers), the final model's gather, a profile's export. The
        watch gives it a larger timeout (--wait-timeout, by default 10 x its own), not none:
        an upload that never ends is still a hang. It counts as progress when it ends."""
        self.waiting = True
        try:
            yield
        finally:
            self.waiting = False
            self.tick()

    def close(self) -> None:
        """The loop is over: tell the watch this rank is done, so the time Ray Train
        takes to end the run is not a hang."""
        if self.watch is None:
            return
        self._stop.set()
        self.paused = True
        try:
            import ray

            ray.get(self._beat(), timeout=10)
        except Exception:  # the watch is the driver's: its loss never fails training
            pass

    def _beat(self):
        return self.watch.beat.remote(self.rank, os.getpid(), self.node_id, self.ip, self.step, self.progress,
                                      self.paused, self.waiting, self.group)

    def _run(self) -> None:
        import ray

        while not self._stop.wait(self.interval_s):
            try:
                command = ray.get(self._beat(), timeout=30)
                if command == "stacks":
                    text, waiting, where = capture_stacks(self._main)
                    ray.get(self.watch.put_stacks.remote(self.rank, self.node_id, os.getpid(), text, waiting, where),
                            timeout=30)
                    # then the process group's own record (how far this rank got in the
                    # collectives): after the stacks, which a wedged device must not hold up
                    trace = dump_collectives()
                    if trace is not None:
                        ray.get(self.watch.put_trace.remote(self.rank, trace), timeout=30)
            except Exception:  # a slow or restarting driver: try again at the next beat
                continue


def capture_stacks(main_ident: Optional[int]) -> tuple[str, bool, str]:
    """(every thread's stacks as text, whether the training thread ``main_ident`` waits in
    a collective, where it is: 'file:line in function')."""
    frames = sys._current_frames()
    names = {t.ident: t.name for t in threading.enumerate()}
    parts = [f"pid {os.getpid()}, {time.strftime('%Y-%m-%d %H:%M:%S')}"]
    spy = py_spy_dump(os.getpid())
    if spy:
        parts += ["", "--- py-spy dump ---", spy.rstrip()]
    parts += ["", "--- Python stacks (sys._current_frames) ---"]
    for ident, frame in frames.items():
        label = "training thread" if ident == main_ident else "thread"
        parts += ["", f'{label} {names.get(ident, "?")!r} ({ident}), most recent call last:',
                  "".join(traceback.format_stack(frame)).rstrip()]
    main = frames.get(main_ident) if main_ident is not None else None
    waiting, where = classify_frame(main) if main is not None else (False, "?")
    return "\n".join(parts) + "\n", waiting, where


def classify_frame(frame) -> tuple[bool, str]:
    """Whether a stack waits in a collective, by its innermost frame outside the
    standard library, and that frame as 'file:line in function'."""
    while frame is not None and frame.f_code.co_filename.startswith(_STDLIB) \
            and "site-packages" not in frame.f_code.co_filename:
        frame = frame.f_back
    if frame is None:
        return False, "?"
    path = frame.f_code.co_filename.replace(os.sep, "/")
    where = f"{os.path.basename(path)}:{frame.f_lineno} in {frame.f_code.co_name}"
    return any(p in path for p in _COLLECTIVE_PATHS), where


def py_spy_dump(pid: int, timeout_s: float = 10.0) -> str:
    """py-spy's dump of a process (it ships with ray[default]), or "" where it cannot
    attach (no ptrace permission, not installed)."""
    exe = shutil.which("py-spy") or os.path.join(os.path.dirname(sys.executable), "py-spy")
    if not os.path.exists(exe):
        return ""
    try:
        done = subprocess.run([exe, "dump", "--pid", str(pid)], capture_output=True, text=True,
                              timeout=timeout_s)
    except (OSError, subprocess.SubprocessError):
        return ""
    return done.stdout if done.returncode == 0 else ""


def group_id(device) -> int:
    """An id every rank of this worker group shares and no other group has: rank 0's
    random draw, handed to the others in one all-reduce (``device``: where a tensor for
    the backend lives). It tells the hang watch a new group from the one before, whatever
    rank of it beats first."""
    import random

    import torch
    import torch.distributed as dist

    mine = random.SystemRandom().getrandbits(52) + 1 if dist.get_rank() == 0 else 0  # exact in a float64
    shared = torch.tensor([float(mine)], dtype=torch.float64, device=device)
    dist.all_reduce(shared)
    return int(shared.item())
