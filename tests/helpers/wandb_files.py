"""What an offline W&B run wrote, read back from its files (no network, no wandb API):
each `.wandb` file is W&B's record log (LevelDB's log format after a 7-byte header: 32 KiB
blocks of chunks, each with a 7-byte header of CRC, length and type) of protobuf Records."""

from __future__ import annotations

import glob
import json
import os
import struct
import time
from dataclasses import dataclass, field

BLOCK, HEADER = 32 * 1024, 7
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


@dataclass
class OfflineRun:
    """Every session's records of one W&B run id, in the order they were written."""

    sessions: int = 0
    history: list[dict] = field(default_factory=list)  # each log: {"_step": n, key: value}
    config: dict = field(default_factory=dict)
    summary: dict = field(default_factory=dict)
    exit_codes: list[int] = field(default_factory=list)
    groups: set = field(default_factory=set)


def records(path: str):
    """The protobuf Records of one .wandb file."""
    from wandb.proto import wandb_internal_pb2

    with open(path, "rb") as f:
        data = f.read()
    assert data[:4] == b":W&B", path
    offset, chunks = HEADER, []
    while offset + HEADER <= len(data):
        left = BLOCK - offset % BLOCK
        if left < HEADER:  # a block's tail too short for a header is padding
            offset += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[offset:offset + HEADER])
        if length == 0 and kind == 0:  # zeros: the end of what was written
            break
        chunks.append(data[offset + HEADER:offset + HEADER + length])
        offset += HEADER + length
        if kind in (FULL, LAST):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(b"".join(chunks))
            chunks = []
            yield record


def read_offline_run(wandb_dir: str, run_id: str, timeout_s: float = 0) -> OfflineRun:
    """All the offline sessions of ``run_id`` under ``wandb_dir``/wandb/, oldest first, once
    every session's file holds its exit record (waited on up to ``timeout_s``, where every
    session was finished): wandb-core writes a session's last records
    after ``finish()`` has returned, so a loaded machine may read a file before its tail
    (seen: a summary missing under the full suite)."""
    deadline = time.monotonic() + timeout_s
    while True:
        run = _read_sessions(wandb_dir, run_id)
        if len(run.exit_codes) >= run.sessions or time.monotonic() > deadline:
            return run
        time.sleep(0.2)


def _read_sessions(wandb_dir: str, run_id: str) -> OfflineRun:
    run = OfflineRun()
    # a session started in the same second as another gets a folder named -1, -2, ...
    folders = glob.glob(os.path.join(wandb_dir, "wandb", f"offline-run-*-{run_id}")) + glob.glob(
        os.path.join(wandb_dir, "wandb", f"offline-run-*-{run_id}-*"))
    for path in sorted((os.path.join(f, f"run-{run_id}.wandb") for f in folders), key=os.path.getmtime):
        run.sessions += 1
        for record in records(path):
            kind = record.WhichOneof("record_type")
            if kind == "history":
                row = {item.key or "/".join(item.nested_key): json.loads(item.value_json)
                       for item in record.history.item}
                row["_step"] = record.history.step.num if record.history.HasField("step") else row.get("_step")
                run.history.append(row)
            elif kind == "config":
                run.config.update({u.key: json.loads(u.value_json) for u in record.config.update})
            elif kind == "summary":
                run.summary.update({u.key or "/".join(u.nested_key): json.loads(u.value_json)
                                    for u in record.summary.update})
            elif kind == "run":
                run.groups.add(record.run.run_group)
                run.config.update({u.key: json.loads(u.value_json) for u in record.run.config.update})
            elif kind == "exit":
                run.exit_codes.append(record.exit.exit_code)
    return run
