"""Where a machine's CPU seconds go, process by process, from Linux's /proc: the whole
machine's busy seconds (/proc/stat), and each process's own (/proc/<pid>/stat) sampled
by a thread while a command runs, named by what the process is (Ray names an actor's
process ``ray::Class``). Used by startup.py (one job) and suite_time.py (the test suite).
Elsewhere than Linux every figure is None or empty. Also ``start_ray``: the one local Ray
(its processes on loopback) that recovery.py and snapshot_cost.py run their arms on."""

from __future__ import annotations

import os
import threading


def start_ray():
    """Start a local Ray on loopback, never the cluster RAY_ADDRESS names, each run's Ray
    Train settings its own; return what stops it."""
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # read when Ray is imported: before
    for name in ("RAY_ADDRESS", "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S"):  # ray-ddp sets its own poll
        os.environ.pop(name, None)
    import ray

    ray.init(num_cpus=max(2, os.cpu_count() or 1), include_dashboard=False, logging_level="ERROR",
             log_to_driver=False)
    return ray.shutdown


def busy_cpu_s() -> float | None:
    """CPU seconds the whole machine has spent busy since boot (not idle, not waiting on
    I/O), from /proc/stat; None where there is none."""
    try:
        with open("/proc/stat") as f:
            ticks = [int(v) for v in f.readline().split()[1:]]
    except OSError:
        return None
    idle = ticks[3] + ticks[4]  # idle, iowait
    return (sum(ticks[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def process_cpu() -> dict[int, tuple[float, str]]:
    """Every process's CPU seconds so far and command line, from /proc ({} elsewhere)."""
    out = {}
    if not os.path.isdir("/proc"):
        return out
    tick = os.sysconf("SC_CLK_TCK")
    for pid in (p for p in os.listdir("/proc") if p.isdigit()):
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            with open(f"/proc/{pid}/cmdline") as f:
                title = f.read().replace("\0", " ").strip()
        except OSError:  # it exited meanwhile
            continue
        out[int(pid)] = ((int(fields[11]) + int(fields[12])) / tick, title)
    return out


def better_title(kept: str, new: str) -> str:
    """The title that says what a process is: a Ray worker starts as ``python
    .../default_worker.py``, may idle as ``ray::IDLE``, becomes ``ray::Class`` and later
    names its last call (``ray::execute._shutdown_torch``): the first ``ray::`` title
    other than IDLE is kept."""
    if not kept:
        return new
    named = kept.startswith("ray::") and not kept.startswith("ray::IDLE")
    return new if not named and new.startswith("ray::") else kept


def ray_name(title: str) -> str | None:
    """The actor class or task a Ray worker process runs (``ray::Class.method`` ->
    ``Class``); None for a process that is not a named Ray worker."""
    if not title.startswith("ray::"):
        return None
    words = title[len("ray::"):].split()
    return words[0].split(".")[0] if words else ""


class ProcessSampler:
    """Each process's CPU seconds and best title, sampled every ``every_s`` from start()
    to stop() (a process's last moments before it exits can be missed; the sampling
    itself costs a little CPU, counted under its own process)."""

    def __init__(self, every_s: float = 0.2):
        """Take every process's CPU seconds so far as the baseline; sample nothing yet."""
        self.every_s = every_s
        self.before = process_cpu()
        self.seen = dict(self.before)
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def start(self) -> "ProcessSampler":
        """Start sampling in a thread; return the sampler."""
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop sampling and wait for the thread."""
        self._done.set()
        self._thread.join()

    def _sample(self) -> None:
        """Record every process's CPU seconds and best title every ``every_s`` until stop()."""
        while not self._done.wait(self.every_s):
            for pid, (cpu, title) in process_cpu().items():
                self.seen[pid] = (cpu, better_title(self.seen.get(pid, (0.0, ""))[1], title))

    def spent(self) -> dict[int, tuple[float, str]]:
        """pid -> (CPU seconds since start(), title) for every process that spent any."""
        out = {}
        for pid, (cpu, title) in self.seen.items():
            spent = cpu - self.before.get(pid, (0.0, ""))[0]
            if spent > 0:
                out[pid] = (spent, title)
        return out
