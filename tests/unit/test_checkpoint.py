"""Checkpoint files round-trip, and model.pt is a plain state_dict anyone can load."""

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from ray_ddp.checkpoint.format import MODEL_FILE, STATE_FILE, TrainState, capture_rng, save_checkpoint, snapshot_checkpoint, write_checkpoint
from ray_ddp.errors import CheckpointError
from ray_ddp.checkpoint.verify import find_latest_checkpoint, verify_checkpoint, weights_hash
from ray_ddp.record.folder import run_folder
from ray_ddp.checkpoint.load import load_checkpoint
from ray_ddp.config.train import TrainConfig
from ray_ddp.models.builtin import ToyModel
from ray_ddp.storage import resolve_storage


def trained_toy(seed=0):
    torch.manual_seed(seed)
    model = ToyModel()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for _ in range(3):
        opt.zero_grad()
        model(torch.randn(8, 10)).pow(2).mean().backward()
        opt.step()
    return model, opt


def test_round_trip_restores_weights_optimizer_and_position(tmp_path):
    model, opt = trained_toy()
    state = TrainState(epoch=2, step=40, rng=[capture_rng(), capture_rng()])
    save_checkpoint(str(tmp_path), model, opt, state, {"config": TrainConfig().to_dict()}, rank=0)

    fresh, fresh_opt = ToyModel(), None
    fresh_opt = torch.optim.SGD(fresh.parameters(), lr=0.1, momentum=0.9)
    loaded = load_checkpoint(str(tmp_path), fresh, fresh_opt)
    assert (loaded.epoch, loaded.step, len(loaded.rng)) == (2, 40, 2)
    assert weights_hash(fresh) == weights_hash(model)
    bufs = [fresh_opt.state[p]["momentum_buffer"] for p in fresh.parameters()]
    want = [opt.state[p]["momentum_buffer"] for p in model.parameters()]
    assert all(torch.equal(a, b) for a, b in zip(bufs, want))


def test_a_snapshot_is_a_copy_that_the_next_one_reuses(tmp_path):
    # training goes on while a snapshot is written: it must not share memory with the
    # model, and the next checkpoint copies into the same memory instead of allocating
    model, opt = trained_toy()
    first = snapshot_checkpoint(model, opt, TrainState(1, 10, []), {}, rank=0)
    before = model.net1.weight.detach().clone()
    with torch.no_grad():
        model.net1.weight.add_(1.0)
    assert torch.equal(first.model["net1.weight"], before)
    memory = first.model["net1.weight"].data_ptr()
    momentum = first.train_state["optimizer"]["state"][0]["momentum_buffer"].data_ptr()

    second = snapshot_checkpoint(model, opt, TrainState(2, 20, []), {}, rank=0, reuse=first)
    assert second.model["net1.weight"].data_ptr() == memory
    assert second.train_state["optimizer"]["state"][0]["momentum_buffer"].data_ptr() == momentum
    assert torch.equal(second.model["net1.weight"], model.net1.weight)

    write_checkpoint(str(tmp_path / "step-00000020"), second)
    assert verify_checkpoint(str(tmp_path / "step-00000020")) is None
    loaded = torch.load(tmp_path / "step-00000020" / MODEL_FILE, weights_only=True)
    assert torch.equal(loaded["net1.weight"], model.net1.weight)


def test_model_pt_loads_without_ray_ddp(tmp_path):
    model, opt = trained_toy()
    save_checkpoint(str(tmp_path), model, opt, TrainState(1, 1, []), {}, rank=0)
    expected = [p.tolist() for p in model.parameters()]
    script = textwrap.dedent(f"""
        import sys, json
        sys.modules["ray_ddp"] = None  # any pickled reference to ray_ddp would now fail
        import torch
        from torch import nn
        class ToyModel(nn.Module):
            def __init__(self):
                super().__init__()
                self.net1 = nn.Linear(10, 10); self.relu = nn.ReLU(); self.net2 = nn.Linear(10, 5)
        m = ToyModel()
        m.load_state_dict(torch.load({os.path.join(str(tmp_path), MODEL_FILE)!r}, weights_only=True))
        torch.load({os.path.join(str(tmp_path), STATE_FILE)!r}, weights_only=True)
        print(json.dumps([p.tolist() for p in m.parameters()]))
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    import json

    assert json.loads(out.stdout) == expected


def test_weights_hash_sees_any_change():
    model, _ = trained_toy()
    before = weights_hash(model)
    with torch.no_grad():
        model.net2.bias[0] += 1e-7
    assert weights_hash(model) != before


def test_find_latest_skips_folders_without_meta(tmp_path):
    model, opt = trained_toy()
    for step in (10, 20):
        d = tmp_path / "run" / f"step-{step:08d}"
        d.mkdir(parents=True)
        save_checkpoint(str(d), model, opt, TrainState(step // 10, step, []), {}, rank=0)
    (tmp_path / "run" / "step-00000030").mkdir()  # an upload that never finished
    store = resolve_storage(str(tmp_path))
    scan = find_latest_checkpoint(run_folder(store, "run"))
    assert (scan.latest, scan.meta["step"]) == ("step-00000020", 20)
    assert scan.broken == [("step-00000030", "meta.json is missing or unreadable (a write that never finished)")]
    assert find_latest_checkpoint(run_folder(store, "nothing")).latest is None


def test_truncated_and_corrupt_files_are_named(tmp_path):
    model, opt = trained_toy()
    save_checkpoint(str(tmp_path), model, opt, TrainState(1, 10, []), {}, rank=0)
    assert verify_checkpoint(str(tmp_path)) is None
    data = (tmp_path / MODEL_FILE).read_bytes()
    (tmp_path / MODEL_FILE).write_bytes(data[: len(data) // 2])
    assert verify_checkpoint(str(tmp_path)) == f"model.pt has {len(data) // 2} bytes, {len(data)} were written"
    flipped = bytearray(data)
    flipped[len(data) // 2] ^= 0xFF
    (tmp_path / MODEL_FILE).write_bytes(bytes(flipped))
    assert verify_checkpoint(str(tmp_path)) == "model.pt is corrupt (CRC-32 mismatch)"


class Payload:
    """Stands for arbitrary pickled code in a checkpoint."""

    def __reduce__(self):
        return (print, ("this would run on load",))


def test_pickled_objects_are_refused(tmp_path):
    model, opt = trained_toy()
    save_checkpoint(str(tmp_path), model, opt, TrainState(1, 10, []), {}, rank=0)
    torch.save({"net1.weight": Payload()}, tmp_path / MODEL_FILE)
    with pytest.raises(CheckpointError, match="holds pickled objects, not just tensors"):
        load_checkpoint(str(tmp_path), ToyModel(), torch.optim.SGD(ToyModel().parameters(), lr=0.1))


def test_weights_hash_covers_batchnorm_buffers():
    # BatchNorm's num_batches_tracked is a 0-dim int64 buffer; the running statistics are
    # part of what ranks must agree on, so a change in them changes the fingerprint
    net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
    before = weights_hash(net)
    net.train()
    net(torch.randn(8, 4))  # updates running_mean/var and num_batches_tracked only
    assert weights_hash(net) != before


def test_a_run_whose_only_checkpoint_never_finished_starts_from_scratch_and_a_lost_one_stops(tmp_path):
    """A worker killed while rank 0 wrote the run's first checkpoint leaves a folder without
    meta.json: a checkpoint that never existed, so the same command starts the run again
    from scratch, and says so. A finished checkpoint whose files were lost since (meta.json
    names a model.pt of another size) is the run's state gone: one line, and stop."""
    from ray_ddp.driver.resolve import resolve
    from ray_ddp.driver.start import find_start
    from ray_ddp.errors import ConfigError

    cfg = TrainConfig(storage=str(tmp_path), name="torn", epochs=3, steps_per_epoch=10)
    torn = tmp_path / "torn" / "step-00000010"
    torn.mkdir(parents=True)
    (torn / MODEL_FILE).write_bytes(b"\x00" * 100)  # the upload cut off before its meta.json
    store, lines = resolve_storage(str(tmp_path)), []
    start = find_start(resolve(cfg, None), store, None, lines.append)
    assert (start.resumed_from, start.complete, start.scan.latest, start.scan.newest) == (None, False, None, None)
    assert lines == ["warning: checkpoint step-00000010 of run torn is unusable: meta.json is missing or "
                     "unreadable (a write that never finished) (its folder is removed: it never held a "
                     "checkpoint); starting from scratch: no checkpoint of the run was finished"]
    # gone: left, it would be the run's newest folder, which a restart's checkpoint from Ray
    # must be newer than (the same step-00000010, written again, is not), and --keep-best keeps
    assert not torn.exists()

    model, opt = trained_toy()
    torn.mkdir()
    save_checkpoint(str(tmp_path / "torn" / "step-00000005"), model, opt, TrainState(0, 5, 5, []), {}, rank=0)
    (tmp_path / "torn" / "step-00000005" / MODEL_FILE).write_bytes(b"")  # finished once, lost since
    with pytest.raises(ConfigError, match=r"^run torn has no usable checkpoint \(step-00000005: model.pt has 0 "
                                          r"bytes, \d+ were written\); delete the run folder"):
        find_start(resolve(cfg, None), store, None, lines.append)
    assert torn.exists(), "a run that stops leaves its folder as it was"


def test_a_write_that_never_finished_past_the_newest_checkpoint_is_removed_and_the_run_resumes(tmp_path):
    from ray_ddp.driver.resolve import resolve
    from ray_ddp.driver.start import find_start

    cfg = TrainConfig(storage=str(tmp_path), name="run", epochs=3, steps_per_epoch=10)
    model, opt = trained_toy()
    meta = {"config": cfg.to_dict(), "plan": resolve(cfg, None).planned()}
    save_checkpoint(str(tmp_path / "run" / "step-00000010"), model, opt, TrainState(1, 10, 0, []), meta, rank=0)
    (tmp_path / "run" / "step-00000017").mkdir()  # a preemption's checkpoint, cut off with its node
    lines = []
    start = find_start(resolve(cfg, None), resolve_storage(str(tmp_path)), None, lines.append)
    assert (start.scan.latest, start.scan.newest, start.scan.broken) == ("step-00000010", "step-00000010", [])
    assert start.resumed_from.endswith("/run/step-00000010")
    assert lines == ["warning: checkpoint step-00000017 of run run is unusable: meta.json is missing or unreadable "
                     "(a write that never finished) (its folder is removed: it never held a checkpoint); "
                     "resuming from step-00000010 instead"]
    assert not (tmp_path / "run" / "step-00000017").exists()
