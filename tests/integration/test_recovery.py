"""What survives what: an interrupted driver, torn checkpoints, NaN loss (killed workers:
test_faults.py, at each moment of a run). Weights made infinite, ray_ddp's own check,
the user's model's uninterrupted reference and the interrupted driver's second command
train in plain gloo process groups (tests/helpers/gloo_run.py); the rest on Ray (the
resume past broken checkpoints meets Ray's own list of them: its checkpoint manager's)."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from ray_ddp import ConfigError, TrainingError, run
from ray_ddp.checkpoint.format import MODEL_FILE
from ray_ddp.checkpoint.verify import find_latest_checkpoint, verify_checkpoint
from ray_ddp.record.folder import run_folder
from ray_ddp.observe.runs import list_runs
from ray_ddp.storage import resolve_storage

from ._runs import final_hashes, rows_of, small
from gloo_run import train_in_gloo
from user_models import gate_path

pytestmark = pytest.mark.ray
HELPERS = os.path.join(os.path.dirname(os.path.dirname(__file__)), "helpers")


def wait_for(predicate, timeout=120.0, what="condition"):
    deadline = time.time() + timeout
    while time.time() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def progress_step(run_dir) -> int:
    try:
        return json.loads((run_dir / "progress.json").read_text())["step"]
    except (OSError, ValueError, KeyError):
        return 0


def test_interrupted_driver_then_same_command_matches(full_run, storage, ray_address):
    name = "interrupted-driver"
    # the model holds still at step 16 until its gate opens: Ctrl-C lands mid-run, before
    # epoch 3's checkpoint, however loaded the machine
    argv = [sys.executable, "-m", "ray_ddp", "train", "--model", "user_models:gated_toy",
            "--workers", "2", "--epochs", "3", "--steps-per-epoch", "10", "--batch-size", "16",
            "--report-every", "5", "--warmup-steps", "3", "--clip-grad", "1.0",  # as small()
            "--report-interval", "0",  # every window reaches progress.json: Ctrl-C lands mid-run
            "--storage", str(storage), "--name", name, "--address", ray_address]  # the shared Ray
    env = {**os.environ, "PYTHONPATH": HELPERS}
    if os.path.exists(gate_path(name)):  # an earlier suite's
        os.remove(gate_path(name))
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for(lambda: progress_step(storage / name) >= 15 or proc.poll() is not None, what="step 15")
        assert proc.poll() is None, proc.communicate()
        proc.send_signal(signal.SIGINT)  # Ctrl-C
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, err
    assert "interrupted; run the same command again to resume" in err and "Traceback" not in err
    store = resolve_storage(str(storage))
    assert find_latest_checkpoint(run_folder(store, name)).meta["epoch"] < 3
    listed = {r.name: r for r in list_runs(str(storage))}[name]
    assert listed.state == "interrupted" and listed.epochs_done < 3 and listed.epochs == 3

    os.makedirs(os.path.dirname(gate_path(name)), exist_ok=True)
    open(gate_path(name), "w").close()  # the gate open: the same command again runs to the end
    # (the resume is ray_ddp's own: in the gloo harness; a resume on Ray: the BatchNorm run's below)
    summary = train_in_gloo(small(storage, name, model="user_models:gated_toy"))
    assert summary.resumed_from is not None and summary.epochs_completed == 3
    assert {r.name: r for r in list_runs(str(storage))}[name].state == "complete"
    assert final_hashes(rows_of(summary)) == final_hashes(rows_of(full_run))


def test_weights_made_infinite_by_an_epochs_last_step_are_never_checkpointed(storage):
    name = "inf-weights"
    with pytest.raises(TrainingError) as err:  # the loss of step 10 is finite; its update is not
        train_in_gloo(small(storage, name, model="user_models:inf_grad_at_step_10", clip_grad=0.0))
    # a rank's error ends the fit in one line naming the rank (both raise it: either is first)
    assert re.match(r"training failed on rank [01]: NonFiniteLossError: weights became non-finite \(NaN or "
                    r"inf\) on ranks 0, 1 in epoch 1 by step 10; no checkpoint holds them", str(err.value)), err.value
    assert not list((storage / name).glob("step-*")), "no checkpoint was written"
    assert {r.name: r for r in list_runs(str(storage))}[name].state == "failed"


def test_status_is_not_left_running_when_the_driver_dies_of_another_error(ray_local, tmp_path):
    from ray_ddp.errors import StorageError

    storage, name = tmp_path, "driver-error"
    (storage / name / "progress.json").mkdir(parents=True)  # unreadable: a storage failure
    with pytest.raises(StorageError, match="progress.json"):
        run(small(storage, name, quiet=False), echo=lambda line: None)
    status = json.loads((storage / name / "status.json").read_text())
    assert status["state"] == "failed" and "StorageError" in status["error"]


def test_no_usable_checkpoint_stops_with_one_line(full_run, storage):
    name = "all-broken"
    shutil.copytree(storage / "full", storage / name)  # a finished run whose checkpoints all broke
    for step in ("step-00000020", "step-00000030"):
        (storage / name / step / MODEL_FILE).write_bytes(b"")
    with pytest.raises(ConfigError, match=r"has no usable checkpoint \(step-00000020: model.pt has 0 bytes"):
        run(small(storage, name, epochs=4))


def test_a_checkpoint_whose_write_never_finished_is_written_again_by_a_run_from_scratch(full_run, storage):
    """A worker killed while rank 0 uploaded the run's first checkpoint leaves its folder
    without meta.json: the same command starts over (saying so), writes that checkpoint
    again whole over the torn files, and ends with the weights of a run never stopped."""
    name = "torn-first"
    torn = storage / name / "step-00000010"
    torn.mkdir(parents=True)
    (torn / MODEL_FILE).write_bytes(b"\x00" * 100)  # cut off before its meta.json
    lines: list[str] = []
    summary = train_in_gloo(small(storage, name, quiet=False), echo=lines.append)
    assert ("warning: checkpoint step-00000010 of run torn-first is unusable: meta.json is missing or unreadable "
            "(a write that never finished) (its folder is removed: it never held a checkpoint); starting from "
            "scratch: no checkpoint of the run was finished") in lines
    assert summary.resumed_from is None and summary.epochs_completed == 3
    scan = find_latest_checkpoint(run_folder(resolve_storage(str(storage)), name), verify_crc=True)
    assert (scan.latest, scan.broken) == ("step-00000030", [])
    assert verify_checkpoint(str(torn)) is None, "written again, whole"
    assert final_hashes(rows_of(summary)) == final_hashes(rows_of(full_run))


def test_nan_loss_stops_and_keeps_the_last_good_checkpoint(ray_local, storage):
    name = "nan"
    with pytest.raises(TrainingError) as err:
        run(small(storage, name, model="user_models:nan_after_13"))
    message = str(err.value)
    # every rank stops together (none is left waiting in a collective), at the same window
    assert "loss became non-finite (NaN or inf) on ranks 0, 1 in epoch 2 by step 15" in message, message
    assert {r.name: r for r in list_runs(str(storage))}[name].state == "failed"
    store = resolve_storage(str(storage))
    scan = find_latest_checkpoint(run_folder(store, name))
    assert scan.latest == "step-00000010" and not scan.broken


# A user's model as people write them: a forward that takes a dict, BatchNorm1d and
# BatchNorm2d; its own Dataset (float64 dict items), collate function and loss.
USER_MODEL = dict(model="user_models:dict_batchnorm_net", dataset="user_data:dict_rows",
                  collate="user_data:collate_dicts", loss="user_losses:smooth_l1", batch_size=25,
                  epochs=4, warmup_steps=0, report_interval=0, keep=4,
                  # one intra-op thread, as the gloo harness's full run: BatchNorm's reductions
                  # on more threads sum in another order (a Ray of the tests' own would give 8)
                  cpus_per_worker=1)


@pytest.fixture(scope="module")
def user_model_run(storage):
    """4 uninterrupted epochs of 12 steps: the run the interrupted ones must match. In the
    gloo harness: the model, data, collate and loss are ray_ddp's loop's to run (the
    resume below, on Ray, runs them in Ray workers)."""
    return train_in_gloo(small(storage, "user-model-full", **USER_MODEL))


def test_every_rank_validates_and_hashes_rank_0s_batchnorm_statistics(user_model_run):
    # each rank's forward moves its own running statistics; at an epoch's end every rank
    # takes rank 0's (what it saves), so the fingerprints agree at every epoch end
    rows = rows_of(user_model_run)
    ends = sorted({r["step"] for r in rows if r["weights_hash"] is not None})
    assert ends == [12, 24, 36, 48]
    for step in ends:
        assert len({r["weights_hash"] for r in rows if r["step"] == step}) == 1, step


def test_broken_checkpoints_are_skipped_and_a_batchnorm_model_resumes_bit_identical(user_model_run, storage,
                                                                                      capsys):
    name = "user-model-broken"
    shutil.copytree(storage / "user-model-full", storage / name)  # step-12, -24, -36, -48
    model_pt = storage / name / "step-00000048" / MODEL_FILE
    data = model_pt.read_bytes()
    model_pt.write_bytes(data[:100])  # cut short
    flipped = bytearray((storage / name / "step-00000036" / MODEL_FILE).read_bytes())
    flipped[len(flipped) // 2] ^= 0xFF  # the right size, one byte flipped: only the CRC-32 tells
    (storage / name / "step-00000036" / MODEL_FILE).write_bytes(bytes(flipped))

    resumed = run(small(storage, name, **{**USER_MODEL, "quiet": False}))
    out = capsys.readouterr().out
    assert (f"warning: checkpoint step-00000048 of run {name} is unusable: model.pt has 100 bytes, "
            f"{len(data)} were written; resuming from step-00000024 instead") in out
    assert (f"warning: checkpoint step-00000036 of run {name} is unusable: model.pt is corrupt "
            "(CRC-32 mismatch); resuming from step-00000024 instead") in out
    assert resumed.resumed_from.endswith("step-00000024")
    new_rows = [r for r in rows_of(resumed) if r["step"] > 24]
    assert {r["epoch"] for r in new_rows} == {3, 4}
    # the workers loaded exactly the checkpoint announced: what step-24 holds
    assert {r["loaded_hash"] for r in new_rows if r["loaded_hash"] is not None} == \
        {final_hashes([r for r in rows_of(user_model_run) if r["step"] <= 24])[0]}
    # bit-identical to never stopping (epochs 1-2, then a resume): data order, RNG, momentum
    # and BatchNorm statistics
    assert final_hashes(rows_of(resumed)) == final_hashes(rows_of(user_model_run))
    script = textwrap.dedent(f"""
        import sys
        sys.modules["ray_ddp"] = None
        sys.path.insert(0, {HELPERS!r})
        import torch
        from user_models import DictBatchNormNet
        model = DictBatchNormNet()
        model.load_state_dict(torch.load({resumed.checkpoint + '/' + MODEL_FILE!r}, weights_only=True))
        print(int(model.bn.num_batches_tracked), int(model.bn2d.num_batches_tracked),
              bool(model.bn2d.running_var.ne(1).any()))
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["48", "48", "True"]  # one training forward per step, 48 steps
