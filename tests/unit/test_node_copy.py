"""hf:URI and --init-from URI: one copy per node, however many workers ask at once, kept
for a restart, and made again when the files change (no Ray: processes on this machine,
a file:// URI through pyarrow's filesystem, as an s3:// one goes)."""

from __future__ import annotations

import multiprocessing
import os

from ray_ddp.models.hf import node_copy


def test_workers_asking_at_once_share_one_copy_that_a_restart_reuses(tmp_path, monkeypatch):
    source = tmp_path / "model"
    source.mkdir()
    (source / "config.json").write_text("{}")
    (source / "model.safetensors").write_bytes(b"x" * 1000)
    monkeypatch.setenv("RAY_DDP_HF_CACHE", str(tmp_path / "cache"))
    uri = f"file://{source}"

    with multiprocessing.get_context("fork").Pool(4) as pool:  # 4 workers of one node, at once
        paths = pool.map(node_copy, [uri] * 4)
    assert len(set(paths)) == 1
    copy = paths[0]
    assert sorted(os.listdir(copy)) == ["config.json", "model.safetensors"]
    cache = sorted(os.listdir(tmp_path / "cache"))
    assert len(cache) == 2 and cache[1].endswith(".lock"), cache  # one copy, no partial one left
    copied_at = os.stat(os.path.join(copy, "model.safetensors")).st_mtime_ns

    assert node_copy(uri) == copy  # a restart on this node: nothing copied again
    assert os.stat(os.path.join(copy, "model.safetensors")).st_mtime_ns == copied_at

    (source / "model.safetensors").write_bytes(b"y" * 2000)  # the folder changed: copied again
    fresh = node_copy(uri)
    assert fresh != copy and open(os.path.join(fresh, "model.safetensors"), "rb").read() == b"y" * 2000


def test_a_copy_cut_short_is_cleared_and_made_again(tmp_path, monkeypatch):
    source = tmp_path / "model"
    source.mkdir()
    (source / "config.json").write_text("{}")
    monkeypatch.setenv("RAY_DDP_HF_CACHE", str(tmp_path / "cache"))
    copy = node_copy(f"file://{source}")
    folder = os.path.dirname(copy)
    os.rename(folder, folder + ".partial-dead")  # what a copier killed mid-copy leaves behind
    assert node_copy(f"file://{source}") == copy and os.path.isfile(os.path.join(copy, "config.json"))
    assert not [e for e in os.listdir(tmp_path / "cache") if ".partial-" in e]


def test_a_single_file_keeps_its_name(tmp_path, monkeypatch):
    weights = tmp_path / "init.safetensors"
    weights.write_bytes(b"z" * 10)
    monkeypatch.setenv("RAY_DDP_HF_CACHE", str(tmp_path / "cache"))
    copy = node_copy(f"file://{weights}")
    assert os.path.basename(copy) == "init.safetensors" and open(copy, "rb").read() == b"z" * 10
