"""FSDP on real Ray workers (2 gloo ranks): sharded checkpoints that survive a killed
worker bit for bit, resume on another world size, and export to a plain model.pt."""

from __future__ import annotations

import os
import shutil
import signal
import tempfile
import threading

import pytest
import torch

from ray_ddp import run
from ray_ddp.checkpoint import MODEL_FILE, weights_hash
from ray_ddp.cli import main
from ray_ddp.models import build_mlp
from ray_ddp.sharded import read_model_state

from ._runs import final_hashes, rows_of, small
from .test_recovery import progress_step, wait_for

pytestmark = pytest.mark.ray

# 4 epochs of 8 steps, 2 micro-batches a step, AdamW, clipping over the sharded gradients,
# a warm-up schedule; a checkpoint every epoch, all kept.
COMMON = dict(strategy="fsdp", epochs=4, steps_per_epoch=8, grad_accum=2, optimizer="adamw", lr=0.01,
              report_every=4, report_interval=0, keep=4)
MODELS = {
    "mlp": dict(model="user_models:slow_mlp"),  # the built-in mlp, leaving its pid
    # the built-in gpt (tied embedding: the root shards it) on text, validated every epoch
    # (FSDP's forward is a collective: every rank runs as many validation batches)
    "gpt": dict(model="user_models:slow_gpt", seq_len=16, batch_size=8, val_fraction=0.2),
}


@pytest.fixture(scope="module")
def text(tmp_path_factory):
    path = tmp_path_factory.mktemp("text") / "text.txt"
    path.write_text(("the quick brown fox jumps over the lazy dog. " * 7 + "\n") * 6)
    return str(path)


def config(storage, name, model, text, **kw):
    extra = dict(data=text) if model == "gpt" else {}
    return small(storage, name, **{**COMMON, **MODELS[model], **extra, **kw})


@pytest.fixture(scope="module")
def uninterrupted(ray_local, storage, text):
    """model -> the summary of an uninterrupted FSDP run (made once, when first asked for)."""
    made = {}

    def get(model):
        if model not in made:
            made[model] = run(config(storage, f"fsdp-{model}", model, text))
        return made[model]
    return get


@pytest.mark.parametrize("model", MODELS)
def test_a_killed_worker_resumes_from_the_shards_bit_identical(uninterrupted, storage, text, model):
    reference = uninterrupted(model)
    name = f"fsdp-{model}-killed"
    pid_dir = os.path.join(tempfile.gettempdir(), "ray_ddp_test_pids", name)
    result = {}

    def train():
        try:
            result["summary"] = run(config(storage, name, model, text, max_failures=1))
        except BaseException as err:  # surfaced by the assertions below
            result["error"] = err

    thread = threading.Thread(target=train)
    thread.start()
    steps = reference.steps // 4  # per epoch
    wait_for(lambda: progress_step(storage / name) >= steps + 2 or "error" in result, what="epoch 2")
    pid = int(open(os.path.join(pid_dir, "1.pid")).read())
    os.kill(pid, signal.SIGKILL)
    thread.join(timeout=300)
    assert "error" not in result, result.get("error")
    summary = result["summary"]
    assert summary.epochs_completed == 4
    assert int(open(os.path.join(pid_dir, "1.pid")).read()) != pid, "rank 1 is a new process"
    rows = rows_of(summary)
    assert {r["loaded_hash"] for r in rows if r.get("loaded_hash") is not None}, "a checkpoint was loaded"
    assert final_hashes(rows) == final_hashes(rows_of(reference))
    ref_rows = rows_of(reference)
    assert len({h for h in final_hashes(ref_rows).values()}) == 1, "one model, however sharded"
    if model == "gpt":
        assert summary.val_loss == reference.val_loss  # validated on every row, the same


def epoch_end_hash(rows, step):
    return {r["weights_hash"] for r in rows if r["step"] == step and r.get("weights_hash")}.pop()


@pytest.mark.parametrize("workers", [1, 3])
def test_a_checkpoint_of_2_ranks_resumes_on_another_world_size(uninterrupted, storage, text, workers):
    reference = uninterrupted("mlp")
    name = f"fsdp-mlp-on-{workers}"
    shutil.copytree(storage / "fsdp-mlp", storage / name)
    for step in (24, 32):  # leave step-16 (epoch 2) the newest
        shutil.rmtree(storage / name / f"step-{step:08d}")
    (storage / name / "checkpoint_manager_snapshot.json").unlink()  # Ray's list of the removed
    summary = run(config(storage, name, "mlp", text, workers=workers))
    assert summary.resumed_from.endswith("step-00000016") and summary.epochs_completed == 4
    new_rows = [r for r in rows_of(summary) if r["step"] > 16]
    assert {r["world_size"] for r in new_rows} == {workers}
    assert {r["rank"] for r in new_rows} == set(range(workers))
    # every rank loaded exactly the weights the 2 ranks had at step 16, resharded
    assert {r["loaded_hash"] for r in new_rows if r.get("loaded_hash") is not None} == \
        {epoch_end_hash(rows_of(reference), 16)}


def test_export_consolidates_the_shards_into_a_plain_model_pt(uninterrupted, storage, tmp_path, capsys):
    reference = uninterrupted("mlp")
    rows = rows_of(reference)
    out = tmp_path / "mlp-16.pt"
    assert main(["export", "fsdp-mlp", "--storage", str(storage), "--step", "16", "--out", str(out)]) == 0
    assert capsys.readouterr().out.strip() == (
        f"exported step-00000016 of run fsdp-mlp (consolidated from its shards): 8 tensors, "
        f"{sum(p.numel() for p in build_mlp(10, 5, 64, 3).parameters()):,} values -> {out}")
    plain = build_mlp(10, 5, 64, 3)  # the bare model: no ray_ddp, no FSDP
    plain.load_state_dict(torch.load(out, weights_only=True))
    assert weights_hash(plain) == epoch_end_hash(rows, 16)
    # the last checkpoint holds model.pt, gathered at the end: the shards' weights
    final = torch.load(storage / "fsdp-mlp" / "step-00000032" / MODEL_FILE, weights_only=True)
    shards = read_model_state(str(storage / "fsdp-mlp" / "step-00000032"))
    assert final.keys() == shards.keys() and all(torch.equal(final[k], shards[k]) for k in final)
    plain.load_state_dict(final)
    assert weights_hash(plain) == epoch_end_hash(rows, 32)
    assert not (storage / "fsdp-mlp" / "step-00000016" / MODEL_FILE).exists(), "only the last gets one"
