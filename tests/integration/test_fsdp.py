"""FSDP on real Ray workers (2 gloo ranks): sharded checkpoints that survive a killed
worker bit for bit (against the same run in the gloo harness) and export to a plain
model.pt; in plain gloo process groups (no Ray: resharding is ray_ddp's and DCP's), a
resume on another world size and exact loads on 1 and on 3 ranks."""

from __future__ import annotations

import json
import os
import shutil
import signal
import tempfile

import pytest
import torch

from ray_ddp.checkpoint.format import META_FILE, MODEL_FILE, STATE_FILE
from ray_ddp.record.names import checkpoint_step
from ray_ddp.checkpoint.verify import weights_hash
from ray_ddp.cli.main import main
from ray_ddp.models.builtin import GPT
from ray_ddp.checkpoint.sharded import read_model_state

from ._runs import final_hashes, rows_of, run_in_thread, small, summary_of
from gloo_run import train_in_gloo
from .test_recovery import progress_step, wait_for
from .test_train import HEADER

pytestmark = pytest.mark.ray

# 4 epochs of 6 steps, 2 micro-batches a step, AdamW, clipping over the sharded gradients,
# a warm-up schedule; a checkpoint every epoch, all kept.
COMMON = dict(strategy="fsdp", epochs=4, steps_per_epoch=6, grad_accum=2, optimizer="adamw", lr=0.01,
              report_every=3, report_interval=0, keep=4)
# the built-in gpt (tied embedding: the root shards it) on text, in bf16 (FSDP2's
# MixedPrecisionPolicy), validated every epoch (FSDP's forward is a collective: every rank
# runs as many validation batches), leaving its pid
GPT_RUN = dict(model="fsdp_models:slow_gpt", seq_len=16, batch_size=8, val_fraction=0.2, amp="bf16")


@pytest.fixture(scope="module")
def text(tmp_path_factory):
    path = tmp_path_factory.mktemp("text") / "text.txt"
    path.write_text(("the quick brown fox jumps over the lazy dog. " * 7 + "\n") * 12)
    return str(path)


def config(storage, name, text, **kw):
    return small(storage, name, **{**COMMON, **GPT_RUN, "data": text, **kw})


def plain_gpt():
    """The bare model of GPT_RUN: no ray_ddp wrapper, no FSDP."""
    return GPT(vocab_size=256, width=32, depth=2, heads=4, seq_len=16)


# Two runs, the gpt's sharded checkpoint holding the most (a tied embedding, bf16
# training, validation): an uninterrupted one, the reference of the resume and export
# tests, in the gloo harness (its checkpoints and weights are ray_ddp's own: nothing of
# Ray), and one killed mid-run on Ray, where Ray Train restarts it. (Each Ray Train start
# costs ~18 CPU-s of this 2-core machine, so each Ray run here tests something no other does.)
@pytest.fixture(scope="module")
def fsdp_runs(ray_local, storage, text):
    """The uninterrupted FSDP run (gloo harness), and one on Ray whose rank 1 is SIGKILLed in
    epoch 2 (--max-failures 1), side by side (2 workers each). The killed run checkpoints
    every 4 steps into storage and snapshots its shards into the node's memory every step:
    Ray Train restarts it from the snapshot of the last step done, where a checkpoint per
    epoch would redo epoch 2 from step 6."""
    runs = {"gpt": run_in_thread(None, lambda: train_in_gloo(config(storage, "fsdp-gpt", text))),
            "gpt-killed": run_in_thread(config(storage, "fsdp-gpt-killed", text, max_failures=1,
                                               checkpoint_every_steps=4, keep=8, snapshot_every_steps=1))}
    name = "fsdp-gpt-killed"
    pid_file = os.path.join(tempfile.gettempdir(), "ray_ddp_test_pids", name, "1.pid")
    # past epoch 2's first window: its first checkpoint (epoch 1) is written
    wait_for(lambda: progress_step(storage / name) >= 9 or "error" in runs["gpt-killed"][1],
             timeout=300, what=f"{name} in epoch 2")
    killed_pid = int(open(pid_file).read())
    os.kill(killed_pid, signal.SIGKILL)
    return {key: summary_of(*value) for key, value in runs.items()}, killed_pid


def test_a_killed_worker_resumes_from_the_shards_bit_identical(fsdp_runs):
    summaries, killed_pid = fsdp_runs
    reference, summary = summaries["gpt"], summaries["gpt-killed"]
    pid_file = os.path.join(tempfile.gettempdir(), "ray_ddp_test_pids", "fsdp-gpt-killed", "1.pid")
    assert int(open(pid_file).read()) != killed_pid, "rank 1 is a new process"
    assert summary.epochs_completed == 4
    [event] = summary.events
    assert (event["type"], event["rank"], event["restarted"]) == ("failure", 1, True), event
    # killed once the controller had step 9's rows: restarted from the shards its node held
    # of the last step done (at least step 9's), not from storage (step 8's)
    assert checkpoint_step(event["from_checkpoint"]) >= 9 and event["from_node"] is not None, event
    assert event["steps_lost"] <= 1, event
    rows, ref_rows = rows_of(summary), rows_of(reference)
    assert {r["loaded_hash"] for r in rows if r.get("loaded_hash") is not None}, "a checkpoint was loaded"
    assert len(set(final_hashes(ref_rows).values())) == 1, "one model, however sharded"
    assert final_hashes(rows) == final_hashes(ref_rows)
    assert summary.val_loss == reference.val_loss  # validated on every row, the same


def epoch_end_hash(rows, step):
    return {r["weights_hash"] for r in rows if r["step"] == step and r.get("weights_hash")}.pop()


def test_a_checkpoint_of_2_ranks_resumes_on_1(fsdp_runs, storage, text):
    reference = fsdp_runs[0]["gpt"]
    name = "fsdp-gpt-on-1"
    shutil.copytree(storage / "fsdp-gpt", storage / name)
    shutil.rmtree(storage / name / "step-00000024")  # leave step-18 (epoch 3) the newest
    summary = train_in_gloo(config(storage, name, text, workers=1))
    assert summary.resumed_from.endswith("step-00000018") and summary.epochs_completed == 4
    new_rows = [r for r in rows_of(summary) if r["step"] > 18]
    assert {(r["world_size"], r["rank"]) for r in new_rows} == {(1, 0)}
    # the rank loaded exactly the weights the 2 ranks had at step 18, resharded
    assert {r["loaded_hash"] for r in new_rows if r.get("loaded_hash") is not None} == \
        {epoch_end_hash(rows_of(reference), 18)}


def test_a_sharded_checkpoint_of_2_ranks_loads_exactly_on_1_and_on_3():
    # ray_ddp's sharded checkpoint, written and loaded in plain gloo process groups: 3 ranks
    # shard the 2 ranks' tensors unevenly, and each ends with their weights and AdamW's state
    from dist_matrix import load_a_sharded_checkpoint, run_on_ranks, write_a_sharded_checkpoint

    with tempfile.TemporaryDirectory() as folder:
        wrote = run_on_ranks(2, write_a_sharded_checkpoint, folder)
        assert len(set(wrote)) == 1, "one model, however sharded"
        for world in (1, 3):
            assert run_on_ranks(world, load_a_sharded_checkpoint, folder) == [(wrote[0], 2)] * world, world


def test_an_hsdp_checkpoint_of_2_replicas_x_2_shards_loads_under_fsdp_and_hsdp():
    # each replica trains on rows of its own, and the gradients' all-reduce across the
    # replicas keeps one model; DCP reshards it for fsdp on 3 ranks and hsdp 2 x 2
    from dist_matrix import load_a_sharded_checkpoint, run_on_ranks, write_a_sharded_checkpoint

    with tempfile.TemporaryDirectory() as folder:
        wrote = run_on_ranks(4, write_a_sharded_checkpoint, folder, "hsdp")
        assert len(set(wrote)) == 1, "one model, however sharded and replicated"
        assert run_on_ranks(3, load_a_sharded_checkpoint, folder, "fsdp") == [(wrote[0], 2)] * 3
        assert run_on_ranks(4, load_a_sharded_checkpoint, folder, "hsdp") == [(wrote[0], 2)] * 4


def test_a_restarted_group_resumes_from_the_shards_its_nodes_hold_in_memory(tmp_path):
    """Sharded in-memory snapshots (every rank's own shards, on its node): a restarted
    group loads the newest step whose shards the nodes hold between them, a rank whose
    node lacks its own getting them over the group; the exact weights and AdamW state of
    that step. A slot cut short is passed over for the one before it; a node lost with its
    ranks' shards sends the group to run storage (here none: a fresh start)."""
    from dist_matrix import resume_from_shard_snapshots, run_on_ranks

    got = run_on_ranks(2, resume_from_shard_snapshots, str(tmp_path))
    hashes = got[0]["hashes"]
    assert got[1]["hashes"] == hashes and len(set(hashes.values())) == 3
    assert [g["one node"] for g in got] == [(3, "one", hashes[3], 3)] * 2
    assert [g["own node"] for g in got] == [(3, "node0", hashes[3], 3), (3, "node1", hashes[3], 3)]
    # each on the other's node: its own shards came from the node that wrote them
    assert [g["swapped"] for g in got] == [(3, "node0", hashes[3], 3), (3, "node1", hashes[3], 3)]
    assert [g["cut short"][:2] for g in got] == [(2, "node0"), (2, "node1")]
    assert {g["cut short"][2:] for g in got} == {(hashes[2], 2)}
    assert [g["node lost"][:2] for g in got] == [(0, None), (0, None)]
    assert not list(tmp_path.rglob("fetched-*"))
    # a slot's files are plain PyTorch files
    slot = next(p for p in tmp_path.glob("one/ray_ddp-snapshots/*/fit/slot-*") if (p / "meta.json").exists())
    assert sorted(p.name for p in slot.iterdir()) == ["meta.json", "rank-0.pt", "rank-1.pt", "train_state.pt"]
    assert set(torch.load(slot / "rank-1.pt", weights_only=True)) == {"model", "optim"}


def test_under_hsdp_a_lost_nodes_shards_come_from_their_replica(tmp_path):
    """HSDP's replicas hold the same shards: a node lost with its ranks' snapshots is no
    loss of the step (under FSDP it is: test above), its ranks' shards are their
    replicas', sent over the group, with the exact weights and AdamW state."""
    from dist_matrix import resume_hsdp_when_a_node_is_lost, run_on_ranks

    got = run_on_ranks(2, resume_hsdp_when_a_node_is_lost, str(tmp_path))
    trained = got[0][4]
    assert got[1][4] == trained
    assert [g[:4] for g in got] == [(3, "node0", trained, 3)] * 2
    assert not list(tmp_path.rglob("fetched-*"))


def test_a_restarted_groups_snapshots_never_mix_with_an_earlier_groups_and_a_failed_write_stops_them_all(tmp_path):
    from dist_matrix import run_on_ranks, shard_snapshot_edges

    got = run_on_ranks(2, shard_snapshot_edges, str(tmp_path))
    assert [g[:2] for g in got] == [([5, 6], [5])] * 2
    said, quiet = got[0][2], got[1][2]
    assert said.startswith("in-memory snapshots are off: rank 1 could not write its shards (") and quiet == ""
    assert [g[3] for g in got] == [False, False]


def test_export_consolidates_the_shards_into_a_plain_model_pt(fsdp_runs, storage, tmp_path, capsys):
    reference = fsdp_runs[0]["gpt"]
    rows = rows_of(reference)
    out = tmp_path / "gpt-12.pt"
    assert main(["export", "fsdp-gpt", "--storage", str(storage), "--step", "12", "--out", str(out)]) == 0
    plain = plain_gpt()
    assert capsys.readouterr().out.strip() == (
        f"exported step-00000012 of run fsdp-gpt (consolidated from its shards): {len(plain.state_dict())} "
        f"tensors, {sum(v.numel() for v in plain.state_dict().values()):,} values -> {out}")
    plain.load_state_dict(torch.load(out, weights_only=True))
    assert weights_hash(plain) == epoch_end_hash(rows, 12)
    # the last checkpoint holds model.pt, gathered at the end: the shards' weights
    final = torch.load(storage / "fsdp-gpt" / "step-00000024" / MODEL_FILE, weights_only=True)
    shards = read_model_state(str(storage / "fsdp-gpt" / "step-00000024"))
    assert final.keys() == shards.keys() and all(torch.equal(final[k], shards[k]) for k in final)
    plain.load_state_dict(final)
    assert weights_hash(plain) == epoch_end_hash(rows, 24)
    assert not (storage / "fsdp-gpt" / "step-00000012" / MODEL_FILE).exists(), "only the last gets one"
    # the header both writers write (a DDP checkpoint's: test_train.py)
    meta = json.loads((storage / "fsdp-gpt" / "step-00000012" / META_FILE).read_text())
    state = torch.load(storage / "fsdp-gpt" / "step-00000012" / STATE_FILE, weights_only=True)
    assert set(meta) == HEADER | {"time", "files"} and HEADER <= set(state)
    assert (meta["format"], meta["world_size"], meta["step"]) == ("sharded", 2, 12)
    assert all(meta[k] == state[k] for k in HEADER)
