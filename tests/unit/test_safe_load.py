"""No checkpoint file is unpickled freely: a sharded checkpoint's ``.metadata`` (DCP's
pickle) whose loading would run code is refused, by ``ray-ddp export`` and on resume, and
the non-tensor state loads ``weights_only`` in the new format and the earlier one (no Ray:
a gloo process group of one rank)."""

import json
import pickle
import sys

import pytest
import torch
import pyarrow.fs as pafs

from ray_ddp.checkpoint.format import META_FILE, STATE_FILE, TrainState
from ray_ddp.errors import CheckpointError
from ray_ddp.checkpoint.verify import file_fingerprint, verify_checkpoint
from ray_ddp.cli.main import main
from ray_ddp.checkpoint.sharded import DCP_METADATA, ShardedCheckpointWriter, load_sharded_checkpoint
from ray_ddp.checkpoint.safe_load import read_dcp_metadata, set_at_path

from .test_fsdp import sharded_gpt


class CreatesFile:
    """Unpickled, it opens ``path`` for writing: code run by whoever loads the pickle."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return open, (self.path, "w")


def trained(seed=0):
    model, optimizer = sharded_gpt(seed)
    optimizer.zero_grad()
    model(torch.randint(0, 16, (4, 4))).float().pow(2).mean().backward()
    optimizer.step()
    return model, optimizer


def write_sharded(run_dir, model, optimizer):
    """A checkpoint as training writes it (shards only, no model.pt); its folder."""
    writer = ShardedCheckpointWriter(pafs.LocalFileSystem(), lambda name: str(run_dir / name), rank=0)
    state = TrainState(epoch=1, step=1, rng=[{"torch": torch.get_rng_state()}])
    snapshot = writer.snapshot(model, optimizer, {}, state, {"config": {"model": "gpt"}}, "step-00000001",
                               final=False)
    writer.write(snapshot, "step-00000001")
    return run_dir / "step-00000001"


def plant_code_in_metadata(folder, target):
    """Rewrite .metadata so that unpickling it creates ``target``, and meta.json to match:
    whoever can write the storage can do both."""
    metadata = read_dcp_metadata(str(folder / DCP_METADATA))
    metadata.planner_data = CreatesFile(str(target))
    (folder / DCP_METADATA).write_bytes(pickle.dumps(metadata))
    meta = json.loads((folder / META_FILE).read_text())
    meta["files"][DCP_METADATA] = file_fingerprint(str(folder / DCP_METADATA))
    (folder / META_FILE).write_text(json.dumps(meta))


def test_export_refuses_a_metadata_whose_unpickling_runs_code(one_rank_group, tmp_path, capsys,
                                                              monkeypatch):
    folder = write_sharded(tmp_path / "runs" / "gpt", *trained())
    target = tmp_path / "pwned"
    plant_code_in_metadata(folder, target)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_:
        sys.exit(main(["export", "gpt", "--storage", str(tmp_path / "runs")]))
    assert not target.exists(), "the planted code ran"
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert err.startswith("ray-ddp export: error: checkpoint step-00000001 of run gpt: refusing to load ")
    assert f"{DCP_METADATA}: it names " in err and "open, which is not checkpoint metadata" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["runs"], "nothing exported"


def test_resume_refuses_the_same_metadata(one_rank_group, tmp_path):
    folder = write_sharded(tmp_path / "gpt", *trained())
    target = tmp_path / "pwned"
    plant_code_in_metadata(folder, target)
    with pytest.raises(CheckpointError, match=r"refusing to load .*\.metadata: it names .*open, which "
                                              r"is not checkpoint metadata"):
        load_sharded_checkpoint(str(folder), *sharded_gpt(seed=1))
    assert not target.exists(), "the planted code ran"


def test_shards_hold_only_tensors_and_train_state_the_rest(one_rank_group, tmp_path):
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    model, optimizer = trained()
    for group in optimizer.param_groups:
        group["lr"] = 0.02  # as a schedule leaves it: it must come back from the checkpoint
    folder = write_sharded(tmp_path / "gpt", model, optimizer)
    entries = read_dcp_metadata(str(folder / DCP_METADATA)).state_dict_metadata
    assert all(isinstance(item, TensorStorageMetadata) for item in entries.values())
    fresh, fresh_optimizer = sharded_gpt(seed=1)
    assert load_sharded_checkpoint(str(folder), fresh, fresh_optimizer).step == 1
    assert fresh_optimizer.param_groups[0]["lr"] == 0.02
    assert fresh_optimizer.state_dict()["state"][0]["step"] == 1


def write_earlier_format(folder, model, optimizer, lr=None):
    """What the writer wrote before: the optimizer's param_groups among DCP's entries."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optim_state = get_state_dict(model, optimizer)
    if lr is not None:
        optim_state["param_groups"][0]["lr"] = lr
    dcp.save({"model": model_state, "optim": optim_state},
             storage_writer=dcp.FileSystemWriter(str(folder)))
    torch.save({"epoch": 1, "step": 1, "epoch_step": 0, "rng": [{"torch": torch.get_rng_state()}],
                "config": {}, "saved_by_rank": 0, "format": "sharded"}, folder / STATE_FILE)


def test_a_checkpoint_of_the_earlier_format_still_resumes(one_rank_group, tmp_path):
    model, optimizer = trained()
    write_earlier_format(tmp_path, model, optimizer, lr=0.03)
    fresh, fresh_optimizer = sharded_gpt(seed=1)
    assert load_sharded_checkpoint(str(tmp_path), fresh, fresh_optimizer).step == 1
    assert fresh_optimizer.param_groups[0]["lr"] == 0.03


def test_an_earlier_format_entry_that_needs_unpickling_is_refused(one_rank_group, tmp_path):
    target = tmp_path / "pwned"
    write_earlier_format(tmp_path / "ckpt", *trained(), lr=CreatesFile(str(target)))
    refused = r"refusing to load entry optim\.param_groups\.0\.lr of the shards in .*ckpt: it names .*open, "
    with pytest.raises(CheckpointError, match=refused + "which is not a tensor"):
        load_sharded_checkpoint(str(tmp_path / "ckpt"), *sharded_gpt(seed=1))
    assert not target.exists(), "the planted code ran"


def test_a_manifest_naming_a_file_outside_the_checkpoint_is_refused_before_any_copy(one_rank_group, tmp_path,
                                                                                   capsys, monkeypatch):
    """meta.json is read from storage: a name like ../../x would have export copy (and a
    resume or verification read) outside the checkpoint. Every such name is refused."""
    from ray_ddp.checkpoint.verify import find_latest_checkpoint
    from ray_ddp.record.folder import run_folder
    from ray_ddp.storage import resolve_storage

    folder = write_sharded(tmp_path / "runs" / "gpt", *trained())
    outside = tmp_path / "runs" / "secret.txt"
    outside.write_text("not the checkpoint's")
    meta = json.loads((folder / META_FILE).read_text())
    meta["files"]["../../secret.txt"] = file_fingerprint(str(outside))
    (folder / META_FILE).write_text(json.dumps(meta))
    problem = "meta.json names a file no checkpoint holds ('../../secret.txt'): it was not written by ray_ddp"
    store = resolve_storage(str(tmp_path / "runs"))
    scan = find_latest_checkpoint(run_folder(store, "gpt"), verify_crc=True)
    assert scan.latest is None and scan.broken == [(folder.name, problem)]
    assert verify_checkpoint(str(folder)) == problem
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_:
        sys.exit(main(["export", "gpt", "--storage", str(tmp_path / "runs")]))
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and problem in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["runs"], "nothing exported"


def test_a_sharded_checkpoints_shapes_come_from_its_metadata_alone(one_rank_group, tmp_path):
    from ray_ddp.checkpoint.sharded import read_model_shapes, read_model_state

    folder = write_sharded(tmp_path / "gpt", *trained())
    whole = read_model_state(str(folder))
    for name in [p.name for p in folder.iterdir() if p.name.endswith(".distcp")]:
        (folder / name).unlink()  # the shards gone: only the metadata is read
    shapes = read_model_shapes(str(folder))
    assert set(shapes) == set(whole) and all(shapes[k].shape == whole[k].shape for k in whole)
    assert all(t.device.type == "meta" for t in shapes.values())


@pytest.mark.parametrize("root, path, want", [
    ({}, ("a", "b"), {"a": {"b": 1}}),
    ({}, ("a", 2), {"a": [None, None, 1]}),
    ({"a": [None, {"x": 0}]}, ("a", 1, "y"), {"a": [None, {"x": 0, "y": 1}]}),
    ({"a": [0]}, ("a", 2, 0), {"a": [0, None, [1]]}),
    ({"optim": {"state": {0: {"exp_avg": 0}}}}, ("optim", "state", 0, "step"),
     {"optim": {"state": {0: {"exp_avg": 0, "step": 1}}}}),  # an optimizer's int-keyed dict
])
def test_an_entry_goes_where_dcp_flattened_it_from(root, path, want):
    set_at_path(root, path, 1)
    assert root == want
