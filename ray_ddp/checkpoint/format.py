"""A checkpoint folder's files and how rank 0 writes them: ``model.pt`` (the bare
model's state_dict), ``train_state.pt`` (optimizer, schedule, scaler, RNG, position) and
``meta.json`` (the config, sizes and CRC-32 of every file), and for a Hugging Face model
``hf_config.json`` (its config, naming its class, so that ``ray-ddp export --format hf``
rebuilds it without the user's code). Plain PyTorch files that load with
``torch.load(..., weights_only=True)`` without ray_ddp. Runs on workers.
"""

from __future__ import annotations

import json
import time
import zlib
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence
import pyarrow.fs as pafs
import torch
from torch import nn

# the names live in names.py, which imports no torch; importing them from here still works
from ray_ddp.wrappers import unwrap_peft
from ray_ddp.record.names import (CHECKPOINT_FILES, HF_CONFIG_FILE, META_FILE, MODEL_FILE, STATE_FILE,
                                      checkpoint_dir_name, unexpected_file)


@dataclass
class TrainState:
    """Where training stands: epochs fully done and optimizer steps taken so far."""

    epoch: int = 0
    step: int = 0
    # steps taken in the epoch under way, counted, never derived from steps per epoch: a
    # resume on another world size (or batch) has other steps per epoch
    epoch_step: int = 0
    # one entry per rank: {"torch": ByteTensor, "cuda": [ByteTensor per own GPU]}
    rng: list[dict[str, Any]] = field(default_factory=list)
    # where a resumed run's state came from (never saved): the folder's name, and the node
    # whose in-memory snapshot it was (None: run storage)
    loaded_from: Optional[str] = None
    loaded_from_node: Optional[str] = None
    # an in-memory snapshot's metrics rows not yet sent when it was taken, one list per
    # rank: a restart from it sends them (worker/loop.py)
    rows: list[list[dict[str, Any]]] = field(default_factory=list)


def capture_rng(devices: Sequence[torch.device] = ()) -> dict[str, Any]:
    """This process's RNG state, so a resumed rank draws what it would have drawn: the
    CPU's, and that of this worker's own GPUs (in the order of ``devices``), never every
    visible GPU's: a resume may land on a node with fewer."""
    state: dict[str, Any] = {"torch": torch.get_rng_state()}
    gpus = _distinct_gpus(devices)
    if gpus:
        state["cuda"] = [torch.cuda.get_rng_state(d) for d in gpus]
    return state


def restore_rng(state: dict[str, Any], devices: Sequence[torch.device] = ()) -> None:
    """Put back what ``capture_rng`` took, GPU by GPU onto this worker's own devices."""
    torch.set_rng_state(state["torch"])
    for device, gpu_state in zip(_distinct_gpus(devices), state.get("cuda", [])):
        torch.cuda.set_rng_state(gpu_state, device)


def _distinct_gpus(devices: Sequence[torch.device]) -> list[torch.device]:
    return list(dict.fromkeys(d for d in devices if d.type == "cuda"))


def hf_config_json(model: nn.Module) -> Optional[str]:
    """A Hugging Face model's config as JSON, ``architectures`` naming its class: all that
    ``transformers`` needs to rebuild the model without the user's code. None for any other
    model. A transformers PreTrainedModel is told by its duck type (``save_pretrained`` and
    a ``config`` with ``to_json_string``), so transformers is never imported for it here."""
    config = getattr(model, "config", None)
    if not callable(getattr(model, "save_pretrained", None)) or \
            not callable(getattr(config, "to_json_string", None)):
        return None
    # every field, not the diff from the defaults: the exporting transformers may have others
    fields = json.loads(config.to_json_string(use_diff=False))
    fields["architectures"] = [hf_class_name(model)]
    return json.dumps(fields, indent=2, sort_keys=True) + "\n"


def hf_class_name(model: nn.Module) -> str:
    """The model's own class: FSDP2's ``fully_shard`` swaps in a subclass of its own
    (``FSDPGPT2LMHeadModel``, defined in torch), which transformers does not know; under
    --lora's adapters, the class of the model they adapt."""
    return next(c for c in type(unwrap_peft(model)).__mro__ if not c.__module__.startswith("torch.")).__name__


def to_cpu(obj: Any, into: Any = None) -> Any:
    """A copy with every tensor on the CPU, so a GPU checkpoint loads on any machine. A
    copy even of CPU tensors: training goes on changing the originals while it is
    written. ``into``: an earlier copy of the same structure, whose tensors are reused
    (no fresh allocation, no page faults on hundreds of MB at every checkpoint)."""
    if isinstance(obj, torch.Tensor):
        if isinstance(into, torch.Tensor) and into.shape == obj.shape and into.dtype == obj.dtype:
            return into.copy_(obj.detach())
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        into = into if isinstance(into, dict) else {}
        return {k: to_cpu(v, into.get(k)) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        into = into if isinstance(into, type(obj)) and len(into) == len(obj) else [None] * len(obj)
        return type(obj)(to_cpu(v, w) for v, w in zip(obj, into))
    return obj


@dataclass
class CheckpointSnapshot:
    """A checkpoint's contents copied to host memory, ready to be written while training
    goes on: what model.pt and train_state.pt will hold, and meta.json's fields."""

    model: dict[str, Any]
    train_state: dict[str, Any]
    meta: dict[str, Any]
    hf_config: Optional[str] = None  # hf_config.json's text, for a Hugging Face model only


def checkpoint_header(state: TrainState, run: dict[str, Any], rank: int, sharded: bool = False,
                      world_size: Optional[int] = None) -> dict[str, Any]:
    """What every checkpoint opens with, in meta.json and in train_state.pt alike, whichever
    strategy wrote it: where the run stood, the world size that saved it, the rank that
    saved, the run (``run``: the user's ``config`` and the RunPlan's values, ``plan``,
    apart: a resume on another world size reads the intent, plan.saved_run_config both;
    ``started_from``: the weights its first life started from, kept across resumes), and
    its format ("whole": model.pt holds the model; "sharded": DCP's shards, and model.pt
    only at the run's end). ``world_size``: where ``state.rng`` does not hold every rank's
    (a survivor's save)."""
    return {"epoch": state.epoch, "step": state.step, "epoch_step": state.epoch_step,
            "world_size": len(state.rng) if world_size is None else world_size, "saved_by_rank": rank,
            "config": run.get("config", {}), "plan": run.get("plan", {}),
            "started_from": run.get("started_from"), "format": "sharded" if sharded else "whole"}


def started_from_of(meta: dict[str, Any]) -> Optional[str]:
    """The weights a checkpoint's run started from (its first --init-from), or None for the
    model's own. A checkpoint written before ``started_from`` was recorded has only its
    command's --init-from, which a resume ignores: the best there is."""
    if "started_from" in meta:
        return meta["started_from"]
    return (meta.get("config") or {}).get("init_from")


def snapshot_checkpoint(model: nn.Module, optimizer: torch.optim.Optimizer, state: TrainState,
                        run: dict[str, Any], rank: int, stateful: Optional[dict[str, Any]] = None,
                        reuse: Optional[CheckpointSnapshot] = None, world_size: Optional[int] = None
                        ) -> CheckpointSnapshot:
    """Copy everything a checkpoint holds (one memory copy of weights and optimizer
    state). ``stateful``: more objects with state_dict() (LR schedule, gradient scaler).
    ``reuse``: a snapshot already written, whose memory the copy goes into."""
    header = checkpoint_header(state, run, rank, world_size=world_size)
    return CheckpointSnapshot(
        model=to_cpu(model.state_dict(), reuse.model if reuse else None),
        train_state={
            **header,
            "rng": state.rng,
            "optimizer": to_cpu(optimizer.state_dict(), reuse.train_state["optimizer"] if reuse else None),
            **{name: to_cpu(obj.state_dict()) for name, obj in (stateful or {}).items()},
        },
        meta=header,
        hf_config=hf_config_json(model),  # a small string: the config, not the weights
    )


def write_checkpoint(directory: str, snapshot: CheckpointSnapshot,
                     fs: Optional[pafs.FileSystem] = None) -> None:
    """Write the files into ``directory`` (on ``fs``: any pyarrow filesystem, the local
    disk by default), straight to where they stay. meta.json comes last, with each file's
    size and CRC-32 (counted as the bytes go out, not read back), so a folder cut short is
    recognised as such, and a changed hf_config.json as well as a changed model.pt."""
    fs = fs or pafs.LocalFileSystem()
    fs.create_dir(directory, recursive=True)
    files = {name: save_counted(fs, f"{directory}/{name}", obj)
             for name, obj in ((MODEL_FILE, snapshot.model), (STATE_FILE, snapshot.train_state))}
    if snapshot.hf_config is not None:
        files[HF_CONFIG_FILE] = write_counted(fs, f"{directory}/{HF_CONFIG_FILE}",
                                              snapshot.hf_config.encode())
    write_meta(fs, directory, snapshot.meta, files)


def save_counted(fs: pafs.FileSystem, path: str, obj: Any) -> dict[str, int]:
    """torch.save ``obj`` to ``path`` on ``fs``; its size and CRC-32, counted as the bytes go out."""
    with fs.open_output_stream(path, buffer_size=1 << 20) as stream:
        counted = CountingWriter(stream)
        torch.save(obj, counted)
    return {"bytes": counted.bytes, "crc32": counted.crc32}


def write_counted(fs: pafs.FileSystem, path: str, data: bytes) -> dict[str, int]:
    """Write ``data`` to ``path`` on ``fs``; its size and CRC-32, as meta.json lists them."""
    with fs.open_output_stream(path) as stream:
        stream.write(data)
    return {"bytes": len(data), "crc32": zlib.crc32(data)}


def write_meta(fs: pafs.FileSystem, directory: str, meta: dict[str, Any], files: dict[str, Any]) -> None:
    """meta.json, the last file of a checkpoint: ``meta``, the time, and every file's
    size and CRC-32 (``files``)."""
    with fs.open_output_stream(f"{directory}/{META_FILE}") as stream:
        stream.write(json.dumps({**meta, "time": time.time(), "files": files}).encode())


class CountingWriter:
    """A write-only file for torch.save that counts the bytes and their CRC-32."""

    def __init__(self, stream):
        self.stream, self.bytes, self.crc32 = stream, 0, 0

    def write(self, data) -> int:
        self.crc32 = zlib.crc32(data, self.crc32)
        self.bytes += len(data)
        return self.stream.write(data)

    def flush(self) -> None:
        pass  # the stream flushes when it closes


def save_checkpoint(directory: str, model: nn.Module, optimizer: torch.optim.Optimizer,
                    state: TrainState, run: dict[str, Any], rank: int,
                    stateful: Optional[dict[str, Any]] = None) -> None:
    """Snapshot and write in one go (the loop writes its snapshots off the training thread)."""
    write_checkpoint(directory, snapshot_checkpoint(model, optimizer, state, run, rank, stateful))
