"""``ray-ddp launch``: a user's torchrun-style script run in every process of a spawned
group, its output prefixed with the rank. Runs on the driver.
"""

from __future__ import annotations

import sys
from typing import Optional, Sequence
from ray_ddp.errors import ProcessFailed
from ray_ddp.launch.spawn import DEFAULT_WAIT_S, GroupState, join_processes, plan_processes, run_with_restarts


def launch(argv: list[str], nprocs: int, gpus_per_process: int = 0,
           address: Optional[str] = None, max_failures: int = 0,
           wait_for_resources: float = DEFAULT_WAIT_S) -> int:
    """Run a torchrun-style script in ``nprocs`` processes; returns its exit status
    (rank 0's, or the first failing rank's). Every rank's output lines are printed here
    as they come, prefixed ``[rankN]:`` (stdout to stdout, stderr to stderr); a failed
    rank is named with its error and the last lines of its stderr, as torchrun does."""
    placement = plan_processes(nprocs, gpus_per_process)
    try:
        results = run_with_restarts(placement, address, max_failures, wait_for_resources,
                                     lambda group: _join_scripts(group, argv))
    except ProcessFailed as err:
        print(f"ray-ddp launch: {err}", file=sys.stderr)
        if err.stderr_tail:
            print(f"ray-ddp launch: the last lines rank {err.rank} wrote to stderr:", file=sys.stderr)
            for line in err.stderr_tail:
                print(f"  [rank{err.rank}]: {line}", file=sys.stderr)
        code = err.exit_code or 1
        return 128 - code if code < 0 else code  # killed by signal N: 128 + N, as shells say
    return results[0][0]


def _join_scripts(group: GroupState, argv: list[str], poll_s: float = 0.2) -> list[tuple[int, list[str]]]:
    """Run the script on every rank, printing every rank's lines as they come, until all
    exit 0 or one fails (the others may be blocked in a collective with it)."""
    import ray

    refs = [a.run_script.remote(argv) for a in group.actors]
    printed = [0] * len(refs)

    def print_new() -> None:
        batches = ray.get([a.read_output.remote(n) for a, n in zip(group.actors, printed)])
        for rank, lines in enumerate(batches):
            printed[rank] += len(lines)
            for stream, line in lines:
                print(_with_rank(rank, line), file=sys.stdout if stream == "stdout" else sys.stderr,
                      flush=True)

    def check(rank: int, result: tuple[int, list[str]]) -> None:
        code, tail = result
        if code != 0:
            print_new()  # everything the rank said before the summary
            tail = [_without_rank(rank, line) for line in tail]
            said = _error_line(tail)
            raise ProcessFailed(rank, f"{said}; exited with status {code}" if said else
                                f"exited with status {code}", exit_code=code, stderr_tail=tail)

    results = join_processes(refs, check, on_wait=print_new, poll_s=poll_s)
    print_new()
    return results


def _with_rank(rank: int, line: str) -> str:
    """``[rankN]: line``; PyTorch's own excepthook already prefixes a traceback so (after
    init_process_group), and the prefix is not doubled."""
    return line if line.startswith(f"[rank{rank}]:") else f"[rank{rank}]: {line}"


def _without_rank(rank: int, line: str) -> str:
    prefix = f"[rank{rank}]: "
    return line[len(prefix):] if line.startswith(prefix) else line


def _error_line(tail: Sequence[str]) -> str:
    """A Python traceback's last line (``RuntimeError: ...``), else the last line at all."""
    lines = [line for line in tail if line.strip()]
    return lines[-1].strip() if lines else ""
