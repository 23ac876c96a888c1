"""What a checkpoint or a data folder names is checked, and read no more than needed (no
Ray): a sharded checkpoint's ``.metadata`` may name only the shards its manifest lists; a
save_to_disk folder on a URI is counted from its Arrow messages' headers, not read whole on
the driver; and ``--data DIR`` of such a folder is what the run's config records."""

from __future__ import annotations

import dataclasses
import json
import pickle
import shutil

import pyarrow as pa
import pytest

from ray_ddp.checkpoint.format import META_FILE
from ray_ddp.checkpoint.safe_load import DCP_METADATA, read_dcp_metadata
from ray_ddp.checkpoint.verify import file_fingerprint
from ray_ddp.errors import CheckpointError

from .test_fsdp import sharded_gpt
from .test_safe_load import trained, write_sharded


# ---------------------------------------------------------------- DCP's .metadata
def point_shards_at(folder, name: str) -> None:
    """Rewrite .metadata so every entry is read from ``name``, and meta.json to match:
    whoever can write the storage can do both."""
    metadata = read_dcp_metadata(str(folder / DCP_METADATA))
    metadata.storage_data = {index: dataclasses.replace(info, relative_path=name)
                             for index, info in metadata.storage_data.items()}
    (folder / DCP_METADATA).write_bytes(pickle.dumps(metadata))
    meta = json.loads((folder / META_FILE).read_text())
    meta["files"][DCP_METADATA] = file_fingerprint(str(folder / DCP_METADATA))
    (folder / META_FILE).write_text(json.dumps(meta))


@pytest.mark.parametrize("where", ["parent", "absolute", "unlisted"])
def test_a_metadata_naming_a_file_the_manifest_does_not_list_is_refused(one_rank_group, tmp_path, where):
    from ray_ddp.checkpoint.sharded import load_sharded_checkpoint, read_model_state

    folder = write_sharded(tmp_path / "gpt", *trained())
    shard = next(p for p in folder.iterdir() if p.name.endswith(".distcp"))
    # a copy of a real shard where the name points: without the check, it loads from there
    target = {"parent": folder.parent / "outside.distcp", "absolute": tmp_path / "elsewhere.distcp",
              "unlisted": folder / "__7_0.distcp"}[where]
    shutil.copy(shard, target)
    name = {"parent": "../outside.distcp", "absolute": str(target), "unlisted": "__7_0.distcp"}[where]
    point_shards_at(folder, name)
    refused = rf"^refusing to load .*{DCP_METADATA}: it names {name!r} as a shard"
    with pytest.raises(CheckpointError, match=refused) as err:
        load_sharded_checkpoint(str(folder), *sharded_gpt(seed=1))
    assert "\n" not in str(err.value)
    with pytest.raises(CheckpointError, match=refused):
        read_model_state(str(folder))  # ray-ddp export's and --init-from's read


def test_a_metadata_naming_only_listed_shards_loads(one_rank_group, tmp_path):
    from ray_ddp.checkpoint.sharded import load_sharded_checkpoint

    folder = write_sharded(tmp_path / "gpt", *trained())
    assert load_sharded_checkpoint(str(folder), *sharded_gpt(seed=1)).step == 1


# ---------------------------------------------------------------- save_to_disk on a URI
ROWS_PER_BATCH, BATCHES, FILES, WIDTH = 200, 3, 2, 512  # record batches of 800 kB


def write_saved_folder(folder) -> list[dict]:
    """A save_to_disk folder as ``datasets`` writes one (state.json naming Arrow stream
    files of several record batches each), written with pyarrow; its rows."""
    folder.mkdir()
    rows, files = [], []
    for k in range(FILES):
        name = f"data-{k:05d}-of-{FILES:05d}.arrow"
        batches = []
        for b in range(BATCHES):
            first = (k * BATCHES + b) * ROWS_PER_BATCH
            part = [{"input_ids": [first + i] * WIDTH, "label": (first + i) % 3} for i in range(ROWS_PER_BATCH)]
            batches.append(pa.RecordBatch.from_pylist(part))
            rows += part
        with pa.ipc.new_stream(str(folder / name), batches[0].schema) as writer:
            for batch in batches:
                writer.write_batch(batch)
        files.append({"filename": name})
    (folder / "state.json").write_text(json.dumps({"_data_files": files, "_split": None}))
    return rows


@pytest.fixture
def counted_uri(tmp_path, monkeypatch):
    """(a URI of a save_to_disk folder on a filesystem that is not the local one, as
    s3:// is, the bytes read from it so far, its rows, its data's size in bytes)."""
    from fsspec.implementations.local import LocalFileSystem
    from pyarrow.fs import FSSpecHandler, PyFileSystem

    from ray_ddp.data import saved
    from ray_ddp.storage import Storage

    read = [0]

    class Counted(LocalFileSystem):
        def _open(self, path, mode="rb", **kwargs):
            f = super()._open(path, mode, **kwargs)
            plain = f.read

            def counted(*args):
                data = plain(*args)
                read[0] += len(data)
                return data

            f.read = counted
            return f

    rows = write_saved_folder(tmp_path / "train")
    fs = PyFileSystem(FSSpecHandler(Counted(skip_instance_cache=True)))
    uri = "counted://train"
    monkeypatch.setattr(saved, "resolve_storage",
                        lambda path: Storage(uri=path, fs=fs, path=str(tmp_path / "train")))
    size = sum(p.stat().st_size for p in (tmp_path / "train").glob("*.arrow"))
    return uri, read, rows, size


def test_a_saved_folder_on_a_uri_is_counted_without_reading_its_data(counted_uri):
    from ray_ddp.data.saved import SavedDataset

    uri, read, rows, size = counted_uri
    ds = SavedDataset(uri)
    assert len(ds) == len(rows) == FILES * BATCHES * ROWS_PER_BATCH
    assert read[0] < size / 4, (read[0], size)  # headers, not the record batches' bodies


def test_the_drivers_rows_of_a_uri_are_read_batch_by_batch(counted_uri):
    from ray_ddp.data.saved import SavedDataset

    uri, read, rows, size = counted_uri
    ds = SavedDataset(uri)
    before = read[0]
    assert ds[0] == rows[0] and ds[1] == rows[1] and ds[1000] == rows[1000]
    assert read[0] - before < size / 2, (read[0] - before, size)  # two record batches of six
    assert ds[len(rows) - 1] == rows[-1] and ds[599] == rows[599]
    with pytest.raises(IndexError):
        ds[len(rows)]
    shipped = pickle.loads(pickle.dumps(ds))  # a worker's copy reads its micro-batches whole
    assert shipped.__getitems__([1199, 3, 600]) == [rows[1199], rows[3], rows[600]]


# ---------------------------------------------------------------- the run's config
def test_data_dir_of_a_saved_folder_is_what_the_config_records(tmp_path):
    from hf_data import sentiment_rows

    from ray_ddp import TrainConfig
    from ray_ddp.data.saved import SavedDataset, open_saved_datasets

    sentiment_rows(8, seed=0).save_to_disk(str(tmp_path / "train"))
    given = TrainConfig(data=str(tmp_path / "train"), val_data=str(tmp_path / "train"))
    cfg, train, val = open_saved_datasets(given, None, None)
    assert isinstance(train, SavedDataset) and isinstance(val, SavedDataset)
    assert (cfg.data, cfg.val_data) == (given.data, given.val_data)  # not "synthetic", not None


def test_check_train_data_takes_the_saved_folders_rows_as_the_datas(tmp_path):
    from hf_data import sentiment_rows

    from ray_ddp import ConfigError, TrainConfig
    from ray_ddp.data.checks import check_train_data
    from ray_ddp.data.saved import SavedDataset, open_saved_datasets

    sentiment_rows(8, seed=0).save_to_disk(str(tmp_path / "train"))
    cfg, train, _ = open_saved_datasets(TrainConfig(data=str(tmp_path / "train")), None, None)
    check_train_data(cfg, train)  # the folder's own rows: not "both given"
    other = SavedDataset(str(tmp_path / "train"))
    with pytest.raises(ConfigError, match="give train_data= or --data / --dataset, not both"):
        check_train_data(TrainConfig(data=str(tmp_path / "elsewhere")), other)
