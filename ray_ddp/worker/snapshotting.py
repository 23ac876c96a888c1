"""What a worker keeps in its node's memory (checkpoint/snapshots.py; a sharded run's
shards: checkpoint/shard_snapshots.py): the snapshot taken every --snapshot-every-steps
steps (by default as often as its cost allows), and under DDP a survivor's save when a
peer is lost. Runs on workers.

A survivor's save: when a collective fails because a peer died (gloo says so at once on
the ranks that talk to it; NCCL only where it raises instead of aborting the process),
this rank still holds the state after the last completed step, under DDP the same on
every rank. Before the error ends the worker, the first rank of each node to claim it
writes that state into the node's survivor slot, so the restart redoes only the step
under way, not the steps since the last snapshot. The state is whole only in a step
(the gradients' all-reduce comes before the optimizer's step) and in a snapshot's copy,
never while a window closes (its validation, report or checkpoint may be half done); the
persistent buffers a step's forward changes (BatchNorm's statistics) are put back from
the copy taken before the step. The RNG needs no copy: each step seeds its own
(worker/step.py: ``seed_step``). Every rank's metrics rows not yet sent are on every rank
(``share_rows``, at each window's end): a snapshot or a survivor's save holds them all.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Optional

import torch
import torch.distributed as dist

from ray_ddp.checkpoint.shard_snapshots import NodeShardSnapshots
from ray_ddp.checkpoint.snapshots import NodeSnapshots, node_folder

# what gloo and NCCL say when the peer at the other end of a collective is gone
PEER_LOST = ("Connection reset by peer", "Connection closed by peer", "Broken pipe", "Read error",
             "Write error", "NCCL communicator was aborted", "remote process exited")


def node_snapshots(cfg, strategy, session, scope: str) -> Optional[NodeSnapshots]:
    """--snapshot-every-steps' writer, None when they are off: under DDP the lowest rank
    of each node ``writes`` (the replicas are alike); under a sharded strategy every rank
    writes its own shards (checkpoint/shard_snapshots.py)."""
    if cfg.snapshot_every_steps == 0:
        return None
    folder = node_folder(cfg.storage, cfg.name, scope)
    if strategy.checkpoint_format == "sharded":
        return NodeShardSnapshots(folder, cfg.snapshot_every_steps, session.node_id, lowest=session.local_rank == 0)
    return NodeSnapshots(folder, cfg.snapshot_every_steps, writes=session.local_rank == 0)


def peer_lost(err: BaseException) -> bool:
    """Whether ``err`` is a collective's failure: a peer lost, or the group broken."""
    if isinstance(err, dist.DistError):
        return True
    return isinstance(err, RuntimeError) and any(said in str(err) for said in PEER_LOST)


def persistent_buffers(model) -> list[str]:
    """The names of the buffers a checkpoint holds (BatchNorm's statistics, not a cache
    registered as non-persistent)."""
    saved = set(model.state_dict())
    return [name for name, _ in model.named_buffers() if name in saved]


class Snapshotter:
    """This rank's part in its node's snapshots: the periodic copy (``take``), and where the
    state it holds is whole (``mark_whole``, ``mark_changing``), the survivor's save."""

    def __init__(self, snapshots: Optional[NodeSnapshots], parts, state, run_record: dict, rank: int,
                 world_size: int, reporter):
        self.snapshots, self.parts, self.state, self.run_record = snapshots, parts, state, run_record
        self.rank, self.world_size, self.reporter = rank, world_size, reporter
        self.held: Optional[int] = None  # the step whose whole state this rank holds; None: changing
        self.survives = snapshots is not None and snapshots.survivors  # whole states (DDP), not shards
        self._buffer_names = persistent_buffers(parts.model) if self.survives else []  # once
        self._buffers: dict[str, torch.Tensor] = {}

    def mark_whole(self) -> None:
        """The state after ``state.step`` is whole: a step starts from it. Its persistent
        buffers are copied (the step's forward changes BatchNorm's in place)."""
        if not self.survives:
            return
        self.held = self.state.step
        model = self.parts.model
        self._buffers = {name: model.get_buffer(name).detach().clone() for name in self._buffer_names}

    def mark_changing(self) -> None:
        """A step's state is being closed (its window, validation, checkpoint): no save."""
        self.held = None

    def share_rows(self) -> None:
        """A window's rows kept on every rank until a report sends them (with snapshots on):
        a snapshot or a survivor's save holds them all."""
        if self.snapshots is not None:
            self.reporter.share_unsent()

    def take(self, agreed: bool, heartbeat) -> None:
        """The periodic snapshot, when due: one rank per node writes it, with every rank's
        unsent rows. No collective: the ranks agreed it at the window's end, or by steps."""
        if self.snapshots is None or not self.snapshots.due(self.state.step, agreed) or not self.snapshots.writes:
            return
        started = time.perf_counter()
        with heartbeat.meant_wait():
            self.snapshots.write(self.parts.model, self.parts.optimizer, self.parts.stateful(),
                                 dataclasses.replace(self.state, rng=[]), self.run_record, self.rank,
                                 self.world_size, self.reporter.group_unsent)
            if self.snapshots.off_because is not None:
                if self.snapshots.off_because:  # (a sharded run's: said by rank 0 alone)
                    print(self.snapshots.off_because, flush=True)
                self.snapshots.writes = False
        self.reporter.note_snapshot(started)

    def save_as_survivor(self, err: BaseException) -> None:
        """Where ``err`` says a peer was lost and this rank holds a whole state: that state
        into the node's survivor slot (one rank per node), said in one line. Never raises:
        the error that ends the worker is ``err``."""
        if not self.survives or self.held is None or self.held != self.state.step or not peer_lost(err):
            return
        model, state = self.parts.model, self.state
        try:
            with torch.no_grad():
                for name, value in self._buffers.items():
                    model.get_buffer(name).copy_(value)
            said = self.snapshots.write_survivor(model, self.parts.optimizer, self.parts.stateful(),
                                                 dataclasses.replace(state, rng=[]), self.run_record,
                                                 self.rank, self.world_size, self.reporter.group_unsent)
        except Exception as failed:  # a full disk, the node going down: the restart has the snapshots
            said = f"no survivor's save of step {state.step}: {type(failed).__name__}: {failed}"
        if said:
            print(said, flush=True)
