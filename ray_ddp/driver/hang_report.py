"""What the hang watch (driver/hangs.py) says and keeps of a hang: the event with its
one line (which ranks are not waiting in a collective, and where), and every rank's
stacks and flight recorder under ``<run>/hangs/<step>/``. Runs on the driver.
"""

from __future__ import annotations

import time
from typing import Any

from ray_ddp.record.events import Event
from ray_ddp.worker.collectives import describe_collectives


def hang_event(stall: dict[str, Any], ranks: dict[int, dict], stacks: dict[int, dict]) -> Event:
    """The hang as an event (record/events.py), its cause the one line to print."""
    stuck = sorted(r for r in ranks if not stacks[r]["waiting"])
    waiting = sorted(r for r in ranks if stacks[r]["waiting"])
    head = f"no rank finished a step for {stall['since_s']:.0f} s after step {stall['step']}"
    if stuck:
        named = "; ".join(f"rank {r} on node {ranks[r]['ip'] or ranks[r]['node'][:12]} at {stacks[r]['where']}" for r in stuck)
        cause = f"hang: {head}: not in a collective: {named}"
    else:
        cause = f"hang: {head}: every rank waits in a collective (a lost message, or a peer's device)"
    if waiting and stuck:
        cause += f"; rank{'s' if len(waiting) > 1 else ''} {', '.join(map(str, waiting))} wait{'' if len(waiting) > 1 else 's'} in one"
    first = stuck[0] if stuck else None
    return Event("hang", time.time(), stall["step"], first,
                 (ranks[first]["ip"] or ranks[first]["node"]) if first is not None else None, cause)


def write_stacks(fs, folder: str, stacks: dict[int, dict[str, Any]]) -> None:
    """rank-<r>.txt: the verdict, where, and the stacks; rank-<r>.collectives.json: the
    rank's flight recorder (worker/collectives.py), where it answered with one."""
    fs.create_dir(folder, recursive=True)
    for rank, s in sorted(stacks.items()):
        verdict = "waiting in a collective" if s["waiting"] else "NOT in a collective"
        text = s["text"]
        if s.get("trace"):
            try:
                text += "\n--- collectives (PyTorch's flight recorder) ---\n" + describe_collectives(s["trace"]) + "\n"
            except Exception:  # a record this cannot read: the JSON file still holds it
                pass
        with fs.open_output_stream(f"{folder}/rank-{rank}.txt") as f:
            f.write(f"rank {rank}: {verdict}, at {s['where']}\n{text}".encode())
        if s.get("trace"):
            with fs.open_output_stream(f"{folder}/rank-{rank}.collectives.json") as f:
                f.write(s["trace"].encode())
