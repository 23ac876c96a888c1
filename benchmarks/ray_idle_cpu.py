"""What an idle Ray costs: the CPU each thread of a bare local Ray's processes uses over
20 s while three idle actors wait, largest first, and the total.

Runs on the machine it measures. Ray reads its settings from the environment, so a
setting that might cut Ray's wake-ups is tried by setting it for the command:

    python benchmarks/ray_idle_cpu.py
    RAY_enable_metrics_collection=0 python benchmarks/ray_idle_cpu.py

The figures also go to benchmarks/results/ray_idle_cpu-<machine>-<date>.json, with the
RAY_* settings of the environment (--results-dir, --no-save; see benchmarks/_results.py).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

WINDOW_S = 20
TICK_S = 1 / os.sysconf("SC_CLK_TCK")


def thread_ticks(pid: int) -> dict[tuple[str, str], int]:
    """CPU ticks (user + system) of each thread of ``pid``, keyed by (tid, thread name);
    none for a process that has exited."""
    out = {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            with open(f"/proc/{pid}/task/{tid}/comm") as f:
                out[(tid, f.read().strip())] = int(fields[11]) + int(fields[12])
        except OSError:
            pass
    return out


def descendants() -> dict[int, str]:
    """This process's descendants (the Ray it started: its daemons, and the workers and
    actors its raylet started), as pid -> the start of the command line."""
    parent_of = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    parent_of[int(d)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except OSError:
                pass
    found, frontier = {}, {os.getpid()}
    while frontier:
        frontier = {pid for pid, parent in parent_of.items() if parent in frontier}
        for pid in frontier:
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    found[pid] = f.read().replace(b"\0", b" ").decode(errors="replace")[:60]
            except OSError:
                pass
    return found


def measure() -> tuple[list[tuple[int, str, str]], int, int]:
    """A bare local Ray with three idle actors: each thread's ticks over the window
    (ticks, process, thread), the total ticks, and how many processes there were."""
    import ray

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, logging_level="ERROR",
             _system_config={"prestart_worker_first_driver": False})

    @ray.remote(num_cpus=0)
    class Idle:
        def ready(self) -> bool:
            return True

    actors = [Idle.remote() for _ in range(3)]
    ray.get([a.ready.remote() for a in actors])
    time.sleep(5)  # past the start
    procs = descendants()
    before = {pid: thread_ticks(pid) for pid in procs}
    time.sleep(WINDOW_S)
    rows, total = [], 0
    for pid, name in procs.items():
        for key, ticks in thread_ticks(pid).items():
            used = ticks - before[pid].get(key, 0)
            total += used
            if used:
                rows.append((used, name, key[1]))
    ray.shutdown()
    return rows, total, len(procs)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from _results import add_result_args, kept_env, save_result, this_command

    add_result_args(parser)
    args = parser.parse_args(argv)
    rows, total, processes = measure()
    top = sorted(rows, reverse=True)[:15]
    for used, name, thread in top:
        print(f"{used * TICK_S:5.2f} s  {name:60s} {thread}")
    print(f"total {total * TICK_S:.2f} CPU-s in {WINDOW_S} s across {processes} processes")
    # Ray reads its settings from the environment: the command as it would be typed again
    settings = [f"{k}={v}" for k, v in kept_env().items() if k.startswith("RAY_")]
    command = this_command() if argv is None else ["python", "benchmarks/ray_idle_cpu.py", *argv]
    save_result(args, "ray_idle_cpu", {
        "setup": f"a bare local Ray (num_cpus=2), three idle actors, {WINDOW_S} s window",
        "settings": settings, "window_s": WINDOW_S, "total_cpu_s": total * TICK_S, "processes": processes,
        "top_threads": [{"cpu_s": used * TICK_S, "process": name.strip(), "thread": thread}
                        for used, name, thread in top],
    }, [{"round": 1, "total_cpu_s": total * TICK_S, "processes": processes}], command=settings + command)


if __name__ == "__main__":
    main()
