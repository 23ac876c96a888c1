"""FSDP without Ray: which modules are sharded, and a sharded checkpoint written, checked,
loaded back and exported, in this process (a real gloo process group of one rank)."""

import json

import pytest
import torch
from torch import nn

from ray_ddp import ConfigError, TrainConfig
from ray_ddp.checkpoint.format import META_FILE, MODEL_FILE, TrainState
from ray_ddp.checkpoint.verify import verify_checkpoint, weights_hash
from ray_ddp.export.run import export_model
from ray_ddp.parallel.fsdp import shard_model
from ray_ddp.parallel.units import check_fsdp_wrap, shard_units
from ray_ddp.data.inputs import ValSet
from ray_ddp.models.builtin import GPT, build_mlp
from ray_ddp.checkpoint.sharded import ShardedCheckpointWriter, load_sharded_checkpoint, read_model_state

import pyarrow.fs as pafs
from ray_ddp.driver.resolve import resolve
from flaky_fs import FlakyHandler


class Tied(nn.Module):
    """Input embedding and output layer share one weight; a norm in between."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(20, 8)
        self.norm = nn.LayerNorm(8)
        self.out = nn.Linear(8, 20, bias=False)
        self.out.weight = self.emb.weight
        self.act = nn.GELU()

    def forward(self, ids):
        return self.out(self.act(self.norm(self.emb(ids))))


def fsdp(**kw) -> TrainConfig:
    return TrainConfig(strategy="fsdp", **kw)


def test_default_units_are_gpt_blocks_or_the_children_that_hold_parameters():
    gpt = GPT(vocab_size=16, width=8, depth=3, heads=2, seq_len=4)
    assert shard_units(gpt, fsdp(model="gpt")) == list(gpt.blocks)
    mlp = build_mlp(4, 2, 8, 2)
    assert shard_units(mlp, fsdp(model="mlp")) == [mlp[0], mlp[2], mlp[4]]  # not the GELUs
    tied = Tied()
    assert shard_units(tied, fsdp()) == [tied.norm]  # the tied pair stays with the root


@pytest.mark.parametrize("kind, block", [("gpt2", "GPT2Block"), ("llama", "LlamaDecoderLayer"),
                                         ("t5", "T5Block"), ("bart", "BartEncoderLayer")])
def test_a_hugging_face_model_is_sharded_by_the_blocks_it_names_in_no_split_modules(kind, block):
    """Before, a GPT-2 got no unit (its head's weight is tied to the embedding inside the
    one child that holds every block) and a Llama one unit, its whole decoder: FSDP then
    gathers the whole model at once, and peak memory is DDP's."""
    pytest.importorskip("transformers")
    from hf_tiny import tiny

    model = tiny(kind)
    units = shard_units(model, fsdp(model="hf:tiny"))
    blocks = [m for m in model.modules() if type(m).__name__ in model._no_split_modules]
    assert units == blocks and block in {type(u).__name__ for u in units}
    # the tied embedding and head stay with the root, in no unit
    unit_params = {id(p) for u in units for p in u.parameters()}
    assert id(model.get_input_embeddings().weight) not in unit_params


def test_a_named_block_that_holds_a_tied_weight_stays_in_the_root():
    tied = Tied()
    tied._no_split_modules = ["Embedding", "LayerNorm"]  # the embedding shares its weight with .out
    assert shard_units(tied, fsdp()) == [tied.norm]


def test_a_module_held_at_two_places_is_in_no_unit():
    class Shared(nn.Module):  # one embedding module reached from the root, the encoder and the decoder
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(20, 8)
            self.enc, self.dec, self.norm = nn.Module(), nn.Module(), nn.LayerNorm(8)
            self.enc.e = self.dec.e = self.emb

    shared = Shared()
    assert shard_units(shared, fsdp()) == [shared.norm]
    shared._no_split_modules = ["Embedding", "LayerNorm"]
    assert shard_units(shared, fsdp()) == [shared.norm]


def test_wrap_names_a_class_by_import_path_or_by_name_outermost_only():
    gpt = GPT(vocab_size=16, width=8, depth=2, heads=2, seq_len=4)
    assert shard_units(gpt, fsdp(fsdp_wrap="ray_ddp.models.Block")) == list(gpt.blocks)
    assert shard_units(gpt, fsdp(fsdp_wrap="Block, LayerNorm")) == [gpt.blocks[0], gpt.blocks[1], gpt.ln]
    with pytest.raises(ConfigError, match="--fsdp-wrap TransformerEncoderLayer names no module of model gpt"):
        check_fsdp_wrap(fsdp(model="gpt", fsdp_wrap="TransformerEncoderLayer"), gpt)


def test_validation_batches_are_as_many_on_every_rank_when_asked():
    val = ValSet(33, lambda idx: (idx.float(), idx))
    plain = [[len(x) for x, _ in val.batches(r, 2, 16)] for r in range(2)]
    equal = [[len(x) for x, _ in val.batches(r, 2, 16, equal_counts=True)] for r in range(2)]
    assert plain == [[16], [16, 1]]
    assert equal == [[16, 0], [16, 1]]  # every row once; rank 0 ends with an empty batch


def sharded_gpt(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = shard_model(GPT(vocab_size=16, width=8, depth=2, heads=2, seq_len=4), fsdp(model="gpt"),
                        torch.device("cpu"))
    return model, torch.optim.AdamW(model.parameters(), lr=0.01)


@pytest.mark.parametrize("storage", ["local", "remote"])
def test_a_sharded_checkpoint_is_whole_reloads_exactly_and_exports(one_rank_group, tmp_path, storage):
    """``remote``: storage that is not the local filesystem (as s3:// is): the shards are
    written to a local folder, then copied into it."""
    model, optimizer = sharded_gpt(seed=0)
    ids = torch.randint(0, 16, (4, 4))
    for _ in range(2):
        optimizer.zero_grad()
        model(ids).float().pow(2).mean().backward()
        optimizer.step()
    run = tmp_path / "runs" / "gpt"
    fs = pafs.LocalFileSystem() if storage == "local" else pafs.PyFileSystem(FlakyHandler(fail_opens=0))
    writer = ShardedCheckpointWriter(fs, lambda name: str(run / name), rank=0)
    state = TrainState(epoch=1, step=2, rng=[{"torch": torch.get_rng_state()}])
    snapshot = writer.snapshot(model, optimizer, {}, state, {"config": {"model": "gpt"}}, "step-00000002",
                               final=True)
    trained = weights_hash(model)
    with torch.no_grad():  # training goes on while the shards are written: they hold step 2
        for p in model.parameters():
            p.add_(1.0)
    writer.write(snapshot, "step-00000002")
    folder = run / "step-00000002"
    meta = json.loads((folder / META_FILE).read_text())
    assert sorted(meta["files"]) == [".metadata", "__0_0.distcp", MODEL_FILE, "train_state.pt"]
    assert meta["format"] == "sharded" and verify_checkpoint(str(folder)) is None

    fresh, fresh_optimizer = sharded_gpt(seed=1)
    loaded = load_sharded_checkpoint(str(folder), fresh, fresh_optimizer)
    assert (loaded.epoch, loaded.step) == (1, 2)
    assert weights_hash(fresh) == trained
    assert fresh_optimizer.state_dict()["state"][0]["step"] == 2  # AdamW's moments came back too

    plain = GPT(vocab_size=16, width=8, depth=2, heads=2, seq_len=4)
    plain.load_state_dict(read_model_state(str(folder)))  # the shards alone, no process group used
    assert weights_hash(plain) == trained
    (folder / MODEL_FILE).unlink()  # as with --skip-final-model: export consolidates the shards
    meta["files"].pop(MODEL_FILE)
    (folder / META_FILE).write_text(json.dumps(meta))
    summary = export_model("gpt", str(tmp_path / "runs"), out=str(tmp_path / "gpt.pt"))
    assert summary.sharded and summary.checkpoint == "step-00000002"
    plain.load_state_dict(torch.load(tmp_path / "gpt.pt", weights_only=True))
    assert weights_hash(plain) == trained

    # workers check a shard's size only (each reads just its part; the driver read all)
    shard = folder / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    assert verify_checkpoint(str(folder)) == "__0_0.distcp is corrupt (CRC-32 mismatch)"
    assert verify_checkpoint(str(folder), shards_by_size=True) is None
    shard.write_bytes(bytes(data[:-1]))
    assert verify_checkpoint(str(folder), shards_by_size=True) == \
        f"__0_0.distcp has {len(data) - 1} bytes, {len(data)} were written"


def test_fsdp_on_cpu_workers_returns_freed_gather_buffers_to_the_os(monkeypatch):
    from ray_ddp.cluster.runtime_env import worker_runtime_env

    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_", raising=False)
    env = worker_runtime_env(fsdp(hang_timeout=0), 0)
    assert env["env_vars"]["MALLOC_MMAP_THRESHOLD_"] == str(1 << 20)
    assert worker_runtime_env(fsdp(hang_timeout=0), 1) == {}  # GPU: the buffers are CUDA memory
    assert worker_runtime_env(TrainConfig(hang_timeout=0), 0) == {}  # DDP allocates once
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "33554432")  # the user's own choice wins
    assert worker_runtime_env(fsdp(hang_timeout=0), 0) == {}


def test_hsdp_shards_within_a_node_unless_told_and_the_group_divides_the_world():
    from ray_ddp.parallel.hsdp import shard_group_size

    assert shard_group_size(None, ["a", "a", "b", "b"]) == 2  # a node's ranks
    assert shard_group_size(4, ["a", "a", "b", "b"]) == 4  # one group across both nodes: fsdp
    assert shard_group_size(1, ["a", "a", "b", "b"]) == 1  # every rank a replica: ddp's memory
    with pytest.raises(ConfigError, match="the nodes hold 1 and 3 ranks; give --fsdp-shard-size N"):
        shard_group_size(None, ["a", "b", "b", "b"])
    with pytest.raises(ConfigError, match="--fsdp-shard-size 3 does not divide the 4 ranks"):
        shard_group_size(3, ["a"] * 4)


def test_fsdp_and_hsdp_resume_each_other_but_not_ddp():
    """Both write DCP's shards, which reshard on load; a DDP checkpoint is one model.pt."""
    from ray_ddp.driver.start import check_resumable

    meta = {"epoch": 1, "step": 4, "config": {"strategy": "fsdp"}, "plan": {}}
    check_resumable(resolve(TrainConfig(name="r", strategy="hsdp"), None), meta, "step-00000004", data_decides_steps=True)
    check_resumable(resolve(TrainConfig(name="r", strategy="fsdp"), None), {**meta, "config": {"strategy": "hsdp"}},
                    "step-00000004", data_decides_steps=True)
    with pytest.raises(ConfigError, match="trained with strategy='fsdp' but this command has strategy='ddp'"):
        check_resumable(resolve(TrainConfig(name="r", strategy="ddp"), None), meta, "step-00000004", data_decides_steps=True)
