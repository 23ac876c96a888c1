"""In-memory snapshots of the training state on every node (--snapshot-every-steps): a
checkpoint folder in today's format, written into the node's shared memory (``/dev/shm``)
where it outlives the worker process, so a worker group restarted on the same node
resumes from the last snapshot, not from the last checkpoint in run storage. Runs on
workers; ``drop_node_snapshots`` also in a task the driver sends to every node.

Each node keeps two slots and writes the older one, meta.json last (with every file's
size and CRC-32, as a checkpoint's), having first removed the slot's meta.json: a
snapshot cut short never stands for a whole one, and the other slot still holds the one
before. Under DDP every replica holds the same state, so one rank per node writes (its
lowest), with the metrics rows of every rank not yet sent (``rows``): a restart from the
snapshot sends them, where a restart from a checkpoint redoes their steps. No rank's RNG:
each step seeds its own (worker/step.py).

A node that lacks the newest snapshot a restarted group resumes from gets it from the
lowest rank whose node holds it (``fetch_snapshot``: the files broadcast over the process
group, in chunks: the group's own links, NCCL's on GPUs, never run storage).

A sharded run (FSDP, HSDP) keeps each rank's own shards in the same slots:
checkpoint/shard_snapshots.py.

A third slot, ``survivor``, holds a survivor's save (worker/snapshotting.py): the state a
rank held when a peer was lost, written by the first rank of the node that claims it.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from typing import Optional

import pyarrow.fs as pafs
import torch
import torch.distributed as dist
from torch import nn

from ray_ddp.checkpoint.format import TrainState, snapshot_checkpoint, write_checkpoint
from ray_ddp.record.names import META_FILE
from ray_ddp.checkpoint.verify import verify_checkpoint

FETCH_CHUNK = 64 << 20  # bytes per broadcast of a fetched snapshot: a bounded buffer on each rank
# The share of the node's memory both slots may take: past it the node keeps no snapshot
# (the run goes on with checkpoints in storage), as training needs the host memory too.
MEMORY_SHARE = 0.25
SLOTS = ("slot-a", "slot-b")
SURVIVOR_SLOT = "survivor"
SNAPSHOT_DIR_ENV = "RAY_DDP_SNAPSHOT_DIR"


def snapshot_root() -> str:
    """Where a node's snapshots live: RAY_DDP_SNAPSHOT_DIR, else shared memory (tmpfs),
    else the temporary folder."""
    given = os.environ.get(SNAPSHOT_DIR_ENV)
    if given:
        return given
    return "/dev/shm" if os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()


def run_key(storage: str, name: str) -> str:
    """The folder of one run's snapshots on a node: its name, and a hash of where it is
    stored (two runs of the same name in other storage never share snapshots)."""
    digest = hashlib.sha256(f"{storage}\0{name}".encode()).hexdigest()[:12]
    return f"ray_ddp-snapshots/{name.replace('/', '_')}-{digest}"


def node_folder(storage: str, name: str, scope: str = "") -> str:
    """Where this node keeps the run's snapshots of one fit (``scope``: the WorkerPlan's):
    a later command never takes an earlier one's, whose options may differ."""
    return os.path.join(snapshot_root(), run_key(storage, name), scope or "fit")


@dataclass(frozen=True)
class FoundSnapshot:
    """A whole snapshot on this node: its folder and the step it holds."""

    folder: str
    step: int


def whole_slots(folder: str, world_size: Optional[int], sharded: bool,
                names=(*SLOTS, SURVIVOR_SLOT)) -> list[tuple[str, dict]]:
    """This node's whole slots (``names``) of one kind (a sharded run's, or DDP's), each
    with its meta.json: every file checked against it, CRC-32 included (it is memory,
    read in a moment). ``world_size``: only slots taken at that many ranks (a sharded
    run's shards are cut for its mesh); None: any (DDP's replicas are whole at any world
    size, and a step's rows are the same at the same global batch, as for a checkpoint
    in storage)."""
    found = []
    for slot in names:
        path = os.path.join(folder, slot)
        meta = read_meta(path)
        if meta is None or (world_size is not None and meta.get("world_size") != world_size) \
                or not isinstance(meta.get("step"), int) \
                or (meta.get("format") == "sharded") != sharded or not isinstance(meta.get("files"), dict):
            continue
        if verify_checkpoint(path) is None:
            found.append((path, meta))
    return found


def newest_snapshot(folder: str) -> Optional[FoundSnapshot]:
    """This node's newest whole DDP snapshot, at whatever world size it was taken (an
    elastic run's restart at fewer ranks resumes from it too); None if none."""
    found = [FoundSnapshot(path, int(meta["step"])) for path, meta in whole_slots(folder, None, sharded=False)]
    return max(found, key=lambda f: f.step, default=None)


def read_meta(slot: str) -> Optional[dict]:
    """A slot's meta.json; None when it is missing or torn."""
    try:
        with open(os.path.join(slot, META_FILE)) as f:
            meta = json.load(f)
    except (OSError, ValueError):
        return None
    return meta if isinstance(meta, dict) else None


def fetch_snapshot(found: Optional[str], holder: int, into: str, node_id: Optional[str],
                   device: torch.device) -> tuple[Optional[str], Optional[str]]:
    """The snapshot folder ``found`` on rank ``holder``, sent to every rank (a collective:
    every rank calls it; ``found``: this rank's own copy of that snapshot, or None); a rank
    without one writes what it receives into ``into`` (a folder of its own) and checks it
    against its meta.json. Returns where this rank reads the snapshot (None: its copy is
    not whole) and the holder's node."""
    rank = dist.get_rank()
    header = [None]
    if rank == holder:
        header = [{"node": node_id, "files": {name: os.path.getsize(os.path.join(found, name))
                                               for name in sorted(os.listdir(found))}}]
    dist.broadcast_object_list(header, src=holder)
    receives = found is None
    if receives:
        shutil.rmtree(into, ignore_errors=True)
        os.makedirs(into)
    for name, size in header[0]["files"].items():
        broadcast_file(os.path.join(found, name) if rank == holder else None, size, holder,
                       os.path.join(into, name) if receives else None, device)
    if not receives:
        return found, header[0]["node"]
    return (into if verify_checkpoint(into) is None else None), header[0]["node"]


def broadcast_file(source: Optional[str], size: int, holder: int, target: Optional[str],
                   device: torch.device) -> None:
    """The file ``source`` on rank ``holder`` (``size`` bytes), written to ``target`` on the
    ranks that give one (a collective: every rank calls it), FETCH_CHUNK bytes a broadcast."""
    reader = open(source, "rb") if source is not None else None
    writer = open(target, "wb") if target is not None else None
    try:
        for offset in range(0, size, FETCH_CHUNK):
            chunk = torch.empty(min(FETCH_CHUNK, size - offset), dtype=torch.uint8, device=device)
            if reader is not None:
                chunk.copy_(torch.frombuffer(bytearray(reader.read(chunk.numel())), dtype=torch.uint8))
            dist.broadcast(chunk, src=holder)
            if writer is not None:
                writer.write(chunk.cpu().numpy().tobytes())
    finally:
        for f in (reader, writer):
            if f is not None:
                f.close()


def drop_node_snapshots(storage: str, name: str) -> None:
    """Remove this node's snapshots of the run, every fit's (its end: they are memory;
    a driver killed before its end left its own)."""
    shutil.rmtree(os.path.join(snapshot_root(), run_key(storage, name)), ignore_errors=True)


def state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """The bytes of the weights and the optimizer's state: what one snapshot holds."""
    total = sum(t.numel() * t.element_size() for t in model.state_dict().values() if torch.is_tensor(t))
    for per_param in optimizer.state.values():
        total += sum(t.numel() * t.element_size() for t in per_param.values() if torch.is_tensor(t))
    return total


def node_memory_bytes() -> int:
    """The node's memory (Linux: physical pages), 0 where it cannot be told."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return 0


def _write_slot(slot: str, snapshot, rows: Optional[list] = None) -> None:
    """One slot's files, its meta.json removed first: a cut-short write is never whole."""
    try:
        os.remove(os.path.join(slot, META_FILE))
    except FileNotFoundError:
        pass
    if rows is not None:
        snapshot.train_state["rows"] = rows
    write_checkpoint(slot, snapshot, pafs.LocalFileSystem())


class NodeSnapshots:
    """One node's snapshots, as a rank sees them: when they are due, and, on the rank that
    ``writes`` them, the writing: the older slot each time, meta.json last."""

    survivors = True  # a rank holds the whole state: a survivor's save restarts the group

    def __init__(self, folder: str, every: Optional[int], writes: bool = True):
        self.folder, self.every = folder, every  # None: when the window's end agrees (by cost)
        self.writes = writes  # this rank writes the node's snapshots (the others give their RNG)
        self.off_because: Optional[str] = None  # why this node keeps none (said once)
        self._slot: Optional[int] = None  # the slot written next (0 or 1); None before the first

    def due(self, step: int, agreed: bool = False) -> bool:
        """By steps (--snapshot-every-steps K), or where the ranks agreed at a window's end."""
        return agreed if self.every is None else self.every > 0 and step % self.every == 0

    def write(self, model: nn.Module, optimizer: torch.optim.Optimizer, stateful: dict, state: TrainState,
              run: dict, rank: int, world_size: int, rows: Optional[list] = None) -> None:
        """Write the state after ``state.step`` of ``world_size`` ranks into the older slot
        (``rows``: every rank's metrics rows not yet sent)."""
        if self._slot is None:  # this process's first: is there room, and which slot is older
            self._check_room(model, optimizer)
            self._slot = self._older_slot()
        if self.off_because is not None:
            return
        _write_slot(os.path.join(self.folder, SLOTS[self._slot]),
                    snapshot_checkpoint(model, optimizer, state, run, rank, stateful, world_size=world_size), rows)
        self._slot = 1 - self._slot

    def write_survivor(self, model: nn.Module, optimizer: torch.optim.Optimizer, stateful: dict,
                       state: TrainState, run: dict, rank: int, world_size: int,
                       rows: Optional[list] = None) -> Optional[str]:
        """A survivor's save of the state after ``state.step`` into the survivor slot, by
        the first rank of this node to claim that step (one copy per node: DDP's replicas
        are alike); what was written, or why not (None: another rank claims it)."""
        try:  # the claim: atomic on one node, so two survivors never write one folder
            os.makedirs(self.folder, exist_ok=True)
            os.close(os.open(os.path.join(self.folder, f"survivor-claim-{state.step}"),
                             os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            return None
        need, free, memory = state_bytes(model, optimizer), shutil.disk_usage(self.folder).free, node_memory_bytes()
        if need > (min(free, MEMORY_SHARE * memory - 2 * need) if memory else free):  # beside the two slots
            return f"no survivor's save of step {state.step}: no room for it in {snapshot_root()}"
        _write_slot(os.path.join(self.folder, SURVIVOR_SLOT),
                    snapshot_checkpoint(model, optimizer, state, run, rank, stateful, world_size=world_size), rows)
        return f"rank {rank} saved the state of step {state.step} on its node as a peer was lost"

    def _older_slot(self) -> int:
        """The slot without a whole snapshot, else the one with the older step: a restarted
        worker never overwrites the newest a dead one left."""
        steps = [(read_meta(os.path.join(self.folder, slot)) or {}).get("step", -1) for slot in SLOTS]
        return 0 if steps[0] <= steps[1] else 1

    def _check_room(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """Off, with the reason, when two slots would take more than MEMORY_SHARE of the
        node's memory or more than the free space where they go."""
        need = 2 * state_bytes(model, optimizer)  # (a survivor's save, a third, checks its own room)
        os.makedirs(self.folder, exist_ok=True)
        allowed = snapshot_room(self.folder)
        if need > allowed:
            self.off_because = off_for_room("in-memory snapshots are off on this node: two of them", need, allowed)


def snapshot_room(folder: str) -> int:
    """What a node's snapshots in ``folder`` may take: MEMORY_SHARE of its memory (where
    it can be told), at most the free space there."""
    free = shutil.disk_usage(folder).free
    memory = node_memory_bytes()
    return int(min(MEMORY_SHARE * memory, free)) if memory else free


def off_for_room(what: str, need: int, allowed: int) -> str:
    """The one line that says snapshots are off for want of room (``what``: of what)."""
    return (f"{what} take {need / 2**30:.2f} GiB, over the {allowed / 2**30:.2f} GiB they may use "
            f"({MEMORY_SHARE:.0%} of the memory, or the free space in {snapshot_root()}); the run goes on "
            "with its checkpoints in storage")
