"""In-memory snapshots on a node (checkpoint/snapshots.py): two slots written in turn,
meta.json last, so a snapshot cut short never stands for a whole one; the newest whole
one, at any world size, is found; a node without room keeps none, in one line."""

from __future__ import annotations

import os

import pytest
import torch

from ray_ddp.checkpoint.format import META_FILE, MODEL_FILE, TrainState
from ray_ddp.checkpoint.snapshots import (SLOTS, NodeSnapshots, drop_node_snapshots, newest_snapshot,
                                          node_folder, run_key)
from ray_ddp.models.builtin import ToyModel


def trained(step: int):
    torch.manual_seed(step)
    model = ToyModel()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(4, 10)).sum().backward()
    optimizer.step()
    return model, optimizer


def write(snapshots: NodeSnapshots, step: int, world: int = 2) -> None:
    model, optimizer = trained(step)
    snapshots.write(model, optimizer, {}, TrainState(step=step), {}, rank=0, world_size=world,
                    rows=[[{"step": step, "rank": r}] for r in range(world)])


def test_slots_are_written_in_turn_and_the_newest_whole_one_is_found(tmp_path):
    snapshots = NodeSnapshots(str(tmp_path), every=2)
    assert [s for s in range(1, 7) if snapshots.due(s)] == [2, 4, 6]
    write(snapshots, 2)
    write(snapshots, 4)
    write(snapshots, 6)  # over step 2's slot
    assert sorted(p.name for p in tmp_path.iterdir()) == list(SLOTS)
    found = newest_snapshot(str(tmp_path))
    assert found.step == 6
    saved = torch.load(os.path.join(found.folder, MODEL_FILE), weights_only=True)
    assert torch.equal(saved["net1.weight"], trained(6)[0].state_dict()["net1.weight"])
    # DDP's state is whole at any world size: an elastic restart on fewer ranks takes it too
    write(snapshots, 8, world=1)
    assert newest_snapshot(str(tmp_path)).step == 8


def test_a_snapshot_cut_short_leaves_the_one_before_it(tmp_path):
    snapshots = NodeSnapshots(str(tmp_path), every=1)
    write(snapshots, 1)
    write(snapshots, 2)
    newest = newest_snapshot(str(tmp_path)).folder
    with open(os.path.join(newest, MODEL_FILE), "r+b") as f:  # torn after its meta.json was written
        f.truncate(100)
    assert newest_snapshot(str(tmp_path)).step == 1
    os.remove(os.path.join(newest, META_FILE))  # or killed before meta.json
    assert newest_snapshot(str(tmp_path)).step == 1
    # a restarted writer writes the slot without a whole snapshot, never over step 1's
    again = NodeSnapshots(str(tmp_path), every=1)
    write(again, 3)
    assert newest_snapshot(str(tmp_path)).step == 3
    os.remove(os.path.join(newest_snapshot(str(tmp_path)).folder, META_FILE))
    assert newest_snapshot(str(tmp_path)).step == 1


def test_a_node_without_room_keeps_none_and_says_why(tmp_path, monkeypatch):
    import ray_ddp.checkpoint.snapshots as snapshots_module

    monkeypatch.setattr(snapshots_module, "node_memory_bytes", lambda: 1000)  # a node of 1 kB
    snapshots = NodeSnapshots(str(tmp_path / "s"), every=1)
    write(snapshots, 1)
    assert snapshots.off_because.startswith("in-memory snapshots are off on this node: two of them take")
    assert newest_snapshot(str(tmp_path / "s")) is None


def test_each_run_has_a_folder_of_its_own_and_its_end_drops_it(tmp_path, monkeypatch):
    monkeypatch.setenv("RAY_DDP_SNAPSHOT_DIR", str(tmp_path))
    assert run_key("/a", "run") != run_key("s3://b", "run") != run_key("/a", "other")
    folder = node_folder("/a", "run")
    write(NodeSnapshots(folder, every=1), 1)
    assert newest_snapshot(folder).step == 1
    drop_node_snapshots("/a", "run")
    assert not os.path.exists(folder)


@pytest.mark.parametrize("holders, expected, chunk", [
    ((15, 15), (15, ["node-0", "node-1"]), 0),  # every node holds it: newer than step 10's, each its own
    ((15, None), (15, ["node-0", "node-0"]), 0),  # one node lost it: sent from the other, to every rank
    ((12, 15), (15, ["node-1", "node-1"]), 1000),  # the newest on rank 1's node, sent 1000 bytes at a time
    ((8, None), (10, [None, None]), 0),  # older than storage's step 10: run storage, on every rank
])
def test_every_rank_resumes_from_the_newest_snapshot_on_any_node(tmp_path, holders, expected, chunk):
    """The newest snapshot on any rank's node, newer than run storage's checkpoint, is what
    every rank loads (the same weights: check_ranks_resumed_alike would stop them), sent
    over the group to a node that lacks it and named by the node it came from; the copy
    sent is removed once loaded."""
    from dist_matrix import resume_with_node_snapshots, run_on_ranks
    from ray_ddp.checkpoint.format import save_checkpoint

    model, optimizer = trained(10)
    save_checkpoint(str(tmp_path / "r" / "step-00000010"), model, optimizer, TrainState(step=10, rng=[]), {},
                    rank=0)
    nodes = [str(tmp_path / f"node{r}") for r in range(2)]
    for node, step in zip(nodes, holders):
        os.environ["RAY_DDP_SNAPSHOT_DIR"] = node
        try:
            if step is not None:
                write(NodeSnapshots(node_folder(str(tmp_path), "r"), every=1), step)
        finally:
            del os.environ["RAY_DDP_SNAPSHOT_DIR"]
    got = run_on_ranks(2, resume_with_node_snapshots, str(tmp_path), nodes, chunk)
    step, from_nodes = expected
    assert [g[:2] for g in got] == [(step, f"step-{step:08d}")] * 2
    assert [g[2] for g in got] == from_nodes
    assert [g[3] for g in got] == [trained(step)[0].state_dict()["net1.weight"].sum().item()] * 2
    assert not [p for p in tmp_path.rglob("fetched-*")]


def test_the_default_cadence_keeps_snapshots_within_their_share_of_the_time():
    """Every rank takes rank 0's decision (a rank whose own clock says otherwise too)."""
    from dist_matrix import run_on_ranks, snapshot_cadence_by_cost

    assert run_on_ranks(2, snapshot_cadence_by_cost) == [[False, True, False, True]] * 2


def test_one_survivor_per_node_saves_a_step_and_only_a_peers_loss_counts(tmp_path):
    """The first rank of a node to claim a step writes its survivor's save (the others
    return None: one copy per node), found as the newest snapshot;
    a collective's failure is a peer lost (gloo's words, torch's DistError), another
    error (a bad batch, an optimizer's) never is."""
    import torch.distributed as dist

    from ray_ddp.worker.snapshotting import peer_lost

    snapshots = NodeSnapshots(str(tmp_path), every=None, writes=False)
    model, optimizer = trained(7)
    said = snapshots.write_survivor(model, optimizer, {}, TrainState(step=7), {}, rank=1, world_size=2)
    assert said == "rank 1 saved the state of step 7 on its node as a peer was lost"
    assert snapshots.write_survivor(model, optimizer, {}, TrainState(step=7), {}, rank=0, world_size=2) is None
    found = newest_snapshot(str(tmp_path))
    assert (os.path.basename(found.folder), found.step) == ("survivor", 7)
    gloo = ("[../third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:45269: "
            "Connection reset by peer")
    assert peer_lost(RuntimeError(gloo)) and peer_lost(dist.DistBackendError("NCCL error"))
    assert not peer_lost(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))
    assert not peer_lost(ValueError("Connection reset by peer"))


def test_rows_of_another_world_size_go_out_whole_from_rank_0():
    """A snapshot's unsent rows (each rank's list) resumed at its own world size go out
    with each rank's next report; at another (an elastic restart), no rank holds its own
    list: rank 0 sends the windows whole at the group's start, the others nothing."""
    from types import SimpleNamespace

    from ray_ddp.worker.report import Reporter

    rows = [[{"step": s, "rank": r} for s in (5, 10)] for r in (0, 1)]

    def reporter(rank, world):
        return Reporter(SimpleNamespace(rank=rank, world_size=world), 1e9, torch.device("cpu"), None)

    same = reporter(1, 2)
    assert same.carry(rows) == [] and same.unsent == rows[1] and same.group_unsent == rows
    alone = reporter(0, 1)
    assert alone.carry(rows) == [[rows[0][0], rows[1][0]], [rows[0][1], rows[1][1]]] and alone.unsent == []
    assert reporter(2, 3).carry(rows) == []
