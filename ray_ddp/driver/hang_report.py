"""What the hang watch (driver/hangs.py) keeps of a hang: every rank's stacks and flight
recorder under ``<run>/hangs/<step>/`` (its event is record/events.py's hang_event).
Runs on the driver.
"""

from __future__ import annotations

from typing import Any

from ray_ddp.worker.collectives import describe_collectives


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
