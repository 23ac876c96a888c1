"""In-memory snapshots of a sharded run (--strategy fsdp, hsdp): each rank's own shards of
the weights and optimizer state, written into its node's shared memory beside those of
the node's other ranks, in the two slots of checkpoint/snapshots.py. Runs on workers.

A slot holds ``rank-<r>.pt`` for each rank r of the node (the local tensors of its
shards: ``torch.load(..., weights_only=True)`` reads them), ``train_state.pt`` (what
every rank holds alike: the position, the optimizer's non-tensor entries, the schedule
and scaler, every rank's unsent rows) and meta.json, written last by the node's lowest
rank once every rank's file is written (one all-gather of their sizes and CRC-32s). Every
rank removes the slot's meta.json before it writes, so a slot cut short is never whole.

A restart takes the newest step (not older than the newest checkpoint in storage) whose
files the live nodes hold between them: a rank whose node lacks its own file, or
train_state.pt, gets it from the lowest rank whose node holds it, over the group. Under
FSDP a whole node lost takes its ranks' shards with it: the restart then goes on to run
storage; under HSDP a replica's file stands in for a rank's own (``shard_copies``). No
survivor saves under a sharded strategy: a rank holds only its shards, the dead one's
are gone with it (the snapshot is the restart's state).
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from typing import Any, Callable, Optional

import pyarrow.fs as pafs
import torch
import torch.distributed as dist
from torch import nn

from ray_ddp.checkpoint.agree import collective_device, usable_on_every_rank
from ray_ddp.checkpoint.format import STATE_FILE, TrainState, checkpoint_header, save_counted, to_cpu, write_meta
from ray_ddp.checkpoint.load import load_tensors
from ray_ddp.record.names import META_FILE
from ray_ddp.checkpoint.safe_load import NON_TENSORS
from ray_ddp.checkpoint.sharded import apply_sharded_state, split_tensors
from ray_ddp.checkpoint.snapshots import SLOTS, NodeSnapshots, broadcast_file, off_for_room, read_meta, \
    snapshot_room, whole_slots
from ray_ddp.checkpoint.verify import file_fingerprint
from ray_ddp.errors import CheckpointError


def shard_file(rank: int) -> str:
    """The file of rank ``rank``'s shards in a slot."""
    return f"rank-{rank}.pt"


def shard_copies(model: nn.Module, world: int) -> Callable[[int], list[str]]:
    """The files that hold a rank's shards, its own first: under HSDP also its replicas'
    (the ranks at its place in the other shard groups hold the very same shards, kept
    alike by the all-reduce across groups), so a node lost with its ranks' snapshots
    loses no step while a replica's node holds them; under FSDP its own alone."""
    from torch.distributed.tensor import DTensor

    mesh = next((p.device_mesh for p in model.parameters() if isinstance(p, DTensor)), None)
    group = mesh.size(mesh.ndim - 1) if mesh is not None else world  # the shard dimension is the last
    return lambda r: [shard_file(q) for q in (r, *(q for q in range(r % group, world, group) if q != r))]


def local_shards(model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict[str, Any], dict[str, Any]]:
    """This rank's shards of the weights and optimizer state, copied to host memory (a
    DTensor's local part), and the state's non-tensor entries."""
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.tensor import DTensor

    model_state, optim_state = get_state_dict(model, optimizer)
    tensors, rest = split_tensors({"model": model_state, "optim": optim_state})

    def local(tree):
        if isinstance(tree, dict):
            return {key: local(value) for key, value in tree.items()}
        return tree.to_local() if isinstance(tree, DTensor) else tree

    return to_cpu(local(tensors)), to_cpu(rest)


def _put_shards(into: dict[str, Any], saved: dict[str, Any], where: str = "") -> None:
    """Copy ``saved`` (a snapshot's local tensors) into the sharded state's tensors, in
    place; a shape that differs means another cut of the shards: never loaded."""
    from torch.distributed.tensor import DTensor

    for key, target in into.items():
        name = f"{where}.{key}" if where else str(key)
        if key not in saved:
            raise CheckpointError(f"the snapshot has no {name}")
        if isinstance(target, dict):
            _put_shards(target, saved[key], name)
            continue
        local = target.to_local() if isinstance(target, DTensor) else target
        if local.shape != saved[key].shape:
            raise CheckpointError(f"the snapshot's {name} is {tuple(saved[key].shape)}, this rank's shard "
                                  f"{tuple(local.shape)}")
        with torch.no_grad():
            local.copy_(saved[key])


@dataclass(frozen=True)
class HeldSlot:
    """A whole slot on this node: its folder, the step it holds and its files' sizes and
    CRC-32s (meta.json's)."""

    folder: str
    step: int
    files: dict[str, dict[str, int]]


def held_slots(folder: str, world_size: int) -> list[HeldSlot]:
    """This node's whole sharded slots of ``world_size`` ranks."""
    return [HeldSlot(path, int(meta["step"]), meta["files"])
            for path, meta in whole_slots(folder, world_size, sharded=True, names=SLOTS)]


class NodeShardSnapshots(NodeSnapshots):
    """One node's snapshots of a sharded run, as a rank sees them: every rank writes its
    own shards (a collective: the ranks take a snapshot together), the node's lowest rank
    the rest and meta.json."""

    survivors = False  # a rank holds only its shards: nothing whole to save when a peer dies

    def __init__(self, folder: str, every: Optional[int], node_id: Optional[str], lowest: bool):
        super().__init__(folder, every, writes=True)
        self.node_id, self.lowest = node_id, lowest

    def write(self, model: nn.Module, optimizer: torch.optim.Optimizer, stateful: dict, state: TrainState,
              run: dict, rank: int, world_size: int, rows: Optional[list] = None) -> None:
        tensors, rest = local_shards(model, optimizer)
        if self._slot is None:
            self._start(tensors, state.step, rank, world_size)
        if self.off_because is not None:
            return
        slot = os.path.join(self.folder, SLOTS[self._slot])
        header = checkpoint_header(state, run, rank, sharded=True, world_size=world_size)
        try:  # a full /dev/shm on one rank: every rank turns snapshots off, none waits on it
            files, error = self._write_files(slot, tensors, rest, stateful, header, rows, rank), None
        except OSError as err:
            files, error = {}, f"{type(err).__name__}: {err}"
        written: list = [None] * world_size
        dist.all_gather_object(written, (self.node_id, files, error))  # every rank's file is whole, or said why not
        failed = [(r, said) for r, (_, _, said) in enumerate(written) if said]
        if failed:
            self.off_because = "" if rank else (
                f"in-memory snapshots are off: rank {failed[0][0]} could not write its shards ({failed[0][1]}); "
                "the run goes on with its checkpoints in storage")
            return
        if self.lowest:
            node_files = {name: fp for node, part, _ in written if node == self.node_id for name, fp in part.items()}
            write_meta(pafs.LocalFileSystem(), slot, header, node_files)
        self._slot = 1 - self._slot

    def _start(self, tensors: dict, step: int, rank: int, world_size: int) -> None:
        """This process's first snapshot: is there room on every node, and which slot is
        older (the node's lowest rank's view, taken before any rank writes). A slot that
        holds this step or a later one is a group's before a restart from an older state:
        its meta.json goes, so no node mixes that group's shards with this one's."""
        try:
            os.makedirs(self.folder, exist_ok=True)
            room = snapshot_room(self.folder)
        except OSError:
            room = 0
        everyone: list = [None] * world_size
        dist.all_gather_object(everyone, (self.node_id, rank, _bytes(tensors), room, self._older_slot()))
        self._agree_on_room(everyone, rank)
        self._slot = min((r, slot) for node, r, _, _, slot in everyone if node == self.node_id)[1]
        if self.lowest and self.off_because is None:
            for name in SLOTS:
                if (read_meta(os.path.join(self.folder, name)) or {}).get("step", -1) >= step:
                    _remove_meta(os.path.join(self.folder, name))

    def _write_files(self, slot: str, tensors: dict, rest: dict, stateful: dict, header: dict,
                     rows: Optional[list], rank: int) -> dict[str, dict[str, int]]:
        """This rank's shards into ``slot`` (its meta.json removed first), and on the node's
        lowest rank train_state.pt; each file's size and CRC-32."""
        os.makedirs(slot, exist_ok=True)
        _remove_meta(slot)
        local = pafs.LocalFileSystem()
        files = {shard_file(rank): save_counted(local, f"{slot}/{shard_file(rank)}", tensors)}
        if self.lowest:
            files[STATE_FILE] = save_counted(local, f"{slot}/{STATE_FILE}", {
                **header, "rng": [], NON_TENSORS: rest,
                **{name: to_cpu(obj.state_dict()) for name, obj in stateful.items()},
                **({"rows": rows} if rows else {})})
        return files

    def write_survivor(self, *args, **kwargs) -> Optional[str]:
        return None

    def _agree_on_room(self, everyone: list, rank: int) -> None:
        """Off on every rank (said by rank 0) when two snapshots of a node's ranks would
        take more than MEMORY_SHARE of any node's memory or the free space where they go."""
        nodes: dict[Any, list] = {}
        for node, _, size, room, _ in everyone:
            nodes.setdefault(node, [0, room])[0] += size
        over = [(2 * size, room) for size, room in nodes.values() if 2 * size > room]
        if over:
            need, room = max(over)
            self.off_because = "" if rank else off_for_room(
                "in-memory snapshots are off: two of a node's shards", need, room)


def _remove_meta(slot: str) -> None:
    try:
        os.remove(os.path.join(slot, META_FILE))
    except FileNotFoundError:
        pass


def _bytes(tree: Any) -> int:
    if isinstance(tree, dict):
        return sum(_bytes(value) for value in tree.values())
    return tree.numel() * tree.element_size() if torch.is_tensor(tree) else 0


def load_shard_snapshot(folder: str, stored_step: int, model: nn.Module, optimizer: torch.optim.Optimizer,
                        stateful: dict, node_id: Optional[str]) -> Optional[TrainState]:
    """The newest sharded snapshot whose files the ranks' nodes hold between them, at
    least as new as ``stored_step`` (the newest checkpoint in storage: memory is read
    faster), loaded on every rank; None if there is none, or a rank's copy is not whole.
    A collective: every rank calls it."""
    rank, world = dist.get_rank(), dist.get_world_size()
    mine = {held.step: held for held in held_slots(folder, world)}
    everyone: list = [None] * world
    dist.all_gather_object(everyone, (node_id, {step: held.files for step, held in mine.items()}))
    copies = shard_copies(model, world)

    def whole(step: int) -> bool:  # every rank's shards (its own file or a replica's) and the rest
        held = {name for _, files in everyone for name in files.get(step, {})}
        return STATE_FILE in held and all(any(name in held for name in copies(r)) for r in range(world))

    steps = sorted({step for _, held in everyone for step in held if step >= stored_step}, reverse=True)
    step = next((s for s in steps if whole(s)), None)
    if step is None:
        return None
    fetched = os.path.join(folder, f"fetched-r{rank}")
    paths, source_node = {}, node_id
    try:
        for r in range(world):  # in the same order on every rank: each missing file is one broadcast
            for wanted, names in ((shard_file(r), copies(r)), (STATE_FILE, [STATE_FILE])):
                have = everyone[r][1].get(step, {})
                near = next((name for name in names if name in have), None)
                if near is not None:  # on rank r's node
                    if r == rank:
                        paths[wanted] = os.path.join(mine[step].folder, near)
                    continue
                holder, name = min((q, name) for name in names for q in range(world)
                                   if name in everyone[q][1].get(step, {}))
                want = everyone[holder][1][step][name]
                if r == rank:
                    os.makedirs(fetched, exist_ok=True)
                    paths[wanted], source_node = os.path.join(fetched, wanted), everyone[holder][0]
                broadcast_file(os.path.join(mine[step].folder, name) if rank == holder else None, want["bytes"],
                               holder, paths[wanted] if r == rank else None, collective_device())
                if r == rank and file_fingerprint(paths[wanted]) != want:
                    paths.pop(wanted)
        if not usable_on_every_rank(len(paths) == 2):
            if rank == 0:
                print(f"the snapshot of step {step} could not be sent whole to every rank: resuming from run "
                      "storage", flush=True)
            return None
        shards = load_tensors(paths[shard_file(rank)])
        saved = load_tensors(paths[STATE_FILE])
        state = apply_sharded_state(model, optimizer, stateful, saved, lambda tensors: _put_shards(tensors, shards))
    finally:
        shutil.rmtree(fetched, ignore_errors=True)  # read: the node's own slots hold what it takes next
    state.loaded_from_node = source_node
    return state
