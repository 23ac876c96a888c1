"""Every input path is a Source (data/sources.py), chosen in one place
(data/inputs.py's ``source_kind``): each kind's source gives micro-batches with the
step's share and closes; the validation set given beside it is a ValBatches."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import TensorDataset

from ray_ddp.config.train import TrainConfig
from ray_ddp.data.inputs import SOURCE_KINDS, build_inputs, source_kind
from ray_ddp.data.loader import LoaderSource
from ray_ddp.data.plan import inspect_data
from ray_ddp.driver.resolve import resolve
from ray_ddp.data.ray_data import RayDataTables
from ray_ddp.data.sources import IndexedSource, Source, StreamSource, ValBatches
from ray_ddp.data.synth import SyntheticSource
from ray_ddp.data.synth_files import write_synthetic

CPU = torch.device("cpu")


def resolved(objects=None, **kw):
    """What a worker of 2 gets: the plan for its data, and its batch cut."""
    cfg = TrainConfig(workers=2, batch_size=8, **kw).validate()
    plan = resolve(cfg, inspect_data(cfg, (objects or {}).get("train_data"), (objects or {}).get("val_data")))
    return plan, plan.batch.cut(2)


@pytest.fixture(scope="module")
def table(tmp_path_factory):
    path = tmp_path_factory.mktemp("src") / "set"
    write_synthetic(str(path), rows=100, features=4, targets=2, seed=1, row_group_rows=25)
    return str(path)


def rows(n=50):
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(n, 4, generator=g), torch.randn(n, 2, generator=g))


@pytest.mark.parametrize("kind, options, objects, cls", [
    ("synthetic", {}, {}, SyntheticSource),
    ("rows", {"data": "TABLE"}, {}, IndexedSource),
    ("stream", {"data": "TABLE", "stream": True}, {}, StreamSource),
    ("rows", {"loader_workers": 0}, {"train_data": rows()}, IndexedSource),
    ("loader", {"loader_workers": 1}, {"train_data": rows()}, LoaderSource),
])
def test_each_kind_is_a_source_that_cuts_the_step_and_closes(table, kind, options, objects, cls):
    options = {k: table if v == "TABLE" else v for k, v in options.items()}
    cfg, cut = resolved(objects, **options)
    assert source_kind(cfg, objects) == kind and kind in SOURCE_KINDS
    source, val_set = build_inputs(cfg, cut, 1, CPU, objects)
    assert type(source) is cls and isinstance(source, Source) and val_set is None
    if kind != "loader":  # (its processes are test_loader.py's)
        x, y, share = source.micro_batch(0, 0, 0)
        assert len(x) == len(y) == 8 and share == 16 / 2  # rank 1's half of a 16-row step
    source.close()


def test_ray_data_decides_first_and_its_validation_alone_leaves_the_rows_source(table):
    cfg, _ = resolved(data=table)
    assert source_kind(cfg, {}, RayDataTables(table=object())) == "ray-data"
    assert source_kind(cfg, {}, RayDataTables(val_table=object())) == "rows"


@pytest.mark.parametrize("given", ["val_data", "val_fraction", "val_object", "val_object_loader"])
def test_every_validation_set_is_a_valbatches_counting_each_row_once(table, given):
    objects = {"train_data": rows()} if given.startswith("val_object") else {}
    options = {"val_data": {"data": table, "val_data": table},
               "val_fraction": {"data": table, "val_fraction": 0.2},
               "val_object": {"loader_workers": 0},
               "val_object_loader": {"loader_workers": 1}}[given]
    if given.startswith("val_object"):
        objects["val_data"] = rows(30)
    cfg, cut = resolved(objects, **options)
    _, val_set = build_inputs(cfg, cut, 0, CPU, objects)
    assert isinstance(val_set, ValBatches)
    if given != "val_object_loader":  # (loader processes: test_loader.py's)
        counted = sum(len(b[1]) for b in val_set.batches(0, 1, 8))
        assert counted == {"val_data": 100, "val_fraction": 20, "val_object": 30}[given]


def test_ray_datas_footer_readers_follow_the_number_of_files(tmp_path):
    from ray_ddp.data.ray_data import count_files, footer_readers_for
    from ray_ddp.storage import resolve_storage

    (tmp_path / "set" / "part=a").mkdir(parents=True)
    for name in ("x.parquet", "y.parquet", "part=a/z.parquet"):
        (tmp_path / "set" / name).write_bytes(b"")
    store = resolve_storage(str(tmp_path / "set"))
    assert count_files(store.fs, store.path) == 3
    assert count_files(store.fs, store.path + "/x.parquet") == 1
    # one reader per 10 files (Ray Data's footer batch), never none, never above Ray's 32
    assert [footer_readers_for(n) for n in (0, 1, 10, 11, 95, 320, 10_000)] == [1, 1, 1, 2, 10, 32, 32]
