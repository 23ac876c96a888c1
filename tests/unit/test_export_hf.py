"""``ray-ddp export --format hf``: a checkpoint of a Hugging Face model (DDP's model.pt or
FSDP's shards) becomes a folder ``AutoModel*.from_pretrained`` loads with the trained
weights, rebuilt from the checkpoint's hf_config.json alone; any other model, a changed
hf_config.json or a bad --out is one line and exit 2, with nothing written (no Ray)."""

import json
import os
import sys

import pytest
import torch
import pyarrow.fs as pafs
from safetensors.torch import load_file

from ray_ddp.checkpoint.format import HF_CONFIG_FILE, META_FILE, MODEL_FILE, TrainState
from ray_ddp.checkpoint.load import load_checkpoint
from ray_ddp.checkpoint.verify import file_fingerprint, verify_checkpoint
from ray_ddp.checkpoint.writer import CheckpointWriter
from ray_ddp.cli.main import main
from ray_ddp.models.builtin import ToyModel

transformers = pytest.importorskip("transformers")  # the [hf] extra, which [test] includes

STEP = "step-00000010"


def gpt2():
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=32))


def bert():
    return transformers.BertForSequenceClassification(transformers.BertConfig(
        num_hidden_layers=1, hidden_size=32, num_attention_heads=2, intermediate_size=64,
        vocab_size=64, max_position_embeddings=32, num_labels=3))


def nudged(model):
    """``model`` with every weight moved a little off its init: the export must carry these."""
    torch.manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01 * torch.randn_like(p))
    return model


def write_ddp(run_dir, model, config=None, started_from=None):
    """A checkpoint as rank 0's writer writes it (``config``: the run's, as its meta.json
    records it; ``started_from``: the weights its first life started from); its folder."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    writer = CheckpointWriter(pafs.LocalFileSystem(), lambda name: str(run_dir / name))
    state = TrainState(epoch=1, step=10, rng=[{"torch": torch.get_rng_state()}])
    run = {"config": config or {"model": "hf"}, "started_from": started_from}
    snapshot = writer.snapshot(model, optimizer, {}, state, run, STEP, final=True)
    writer.write(snapshot, STEP)
    return run_dir / STEP


def export_hf(tmp_path, run, out):
    return main(["export", run, "--storage", str(tmp_path / "runs"), "--format", "hf", "--out", str(out)])


def assert_same_weights(loaded, want):
    state = loaded.state_dict()
    assert sorted(state) == sorted(want)
    for key, value in want.items():
        torch.testing.assert_close(state[key], value, rtol=0, atol=0)


@pytest.mark.parametrize("build, auto", [(gpt2, "AutoModelForCausalLM"),
                                         (bert, "AutoModelForSequenceClassification")])
def test_a_ddp_checkpoint_exports_a_folder_from_pretrained_loads(tmp_path, capsys, build, auto):
    model = nudged(build())
    folder = write_ddp(tmp_path / "runs" / "hf", model)
    meta = json.loads((folder / META_FILE).read_text())
    assert sorted(meta["files"]) == [HF_CONFIG_FILE, MODEL_FILE, "train_state.pt"]
    assert verify_checkpoint(str(folder)) is None
    saved = json.loads((folder / HF_CONFIG_FILE).read_text())
    assert saved["architectures"] == [type(model).__name__]

    capsys.readouterr()
    out = tmp_path / "exported"
    assert export_hf(tmp_path, "hf", out) == 0
    line = capsys.readouterr().out.strip()
    assert line.startswith(f"exported {STEP} of run hf (copied) as Hugging Face {type(model).__name__}: ")
    assert line.endswith(f"-> {out} (" + ", ".join(sorted(os.listdir(out))) + ")")
    assert "model.safetensors" in os.listdir(out)
    assert not [p for p in tmp_path.iterdir() if ".partial-" in p.name]
    loaded = getattr(transformers, auto).from_pretrained(str(out), local_files_only=True)
    assert type(loaded) is type(model)
    assert_same_weights(loaded, model.state_dict())
    if build is bert:
        assert loaded.config.num_labels == 3

    # the extra file changes nothing for a resume or for the default export
    fresh = build()
    load_checkpoint(str(folder), fresh, torch.optim.SGD(fresh.parameters(), lr=0.1))
    assert_same_weights(fresh, model.state_dict())
    assert main(["export", "hf", "--storage", str(tmp_path / "runs"), "--out", str(tmp_path / "m.pt")]) == 0
    plain = torch.load(tmp_path / "m.pt", weights_only=True)
    assert sorted(plain) == sorted(model.state_dict())


def test_an_fsdp_checkpoint_exports_from_its_shards(one_rank_group, tmp_path):
    from ray_ddp.checkpoint.sharded import ShardedCheckpointWriter, load_sharded_checkpoint
    from ray_ddp.config.train import TrainConfig
    from ray_ddp.parallel.fsdp import shard_model

    def sharded():
        model = shard_model(nudged(gpt2()), TrainConfig(strategy="fsdp", fsdp_wrap="GPT2Block"),
                            torch.device("cpu"))
        return model, torch.optim.AdamW(model.parameters(), lr=0.01)

    model, optimizer = sharded()
    ids = torch.randint(0, 64, (2, 8))
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    trained = {k: v.full_tensor() for k, v in model.state_dict().items()}
    run = tmp_path / "runs" / "gpt"
    writer = ShardedCheckpointWriter(pafs.LocalFileSystem(), lambda name: str(run / name), rank=0)
    state = TrainState(epoch=1, step=10, rng=[{"torch": torch.get_rng_state()}])
    writer.write(writer.snapshot(model, optimizer, {}, state, {}, STEP, final=False), STEP)  # shards only
    folder = run / STEP
    meta = json.loads((folder / META_FILE).read_text())
    assert MODEL_FILE not in meta["files"] and HF_CONFIG_FILE in meta["files"]
    # fully_shard swaps in a class of its own (FSDPGPT2LMHeadModel): the config names the model's
    assert json.loads((folder / HF_CONFIG_FILE).read_text())["architectures"] == ["GPT2LMHeadModel"]

    assert export_hf(tmp_path, "gpt", tmp_path / "out") == 0
    loaded = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"), local_files_only=True)
    assert_same_weights(loaded, trained)
    fresh, fresh_optimizer = sharded()  # and it resumes as before
    assert load_sharded_checkpoint(str(folder), fresh, fresh_optimizer).step == 10


def one_error_line(capsys) -> str:
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    return err.strip()


def test_a_model_that_is_not_hugging_faces_is_one_line_and_exit_2(tmp_path, capsys, monkeypatch):
    folder = write_ddp(tmp_path / "runs" / "toy", ToyModel())
    assert HF_CONFIG_FILE not in json.loads((folder / META_FILE).read_text())["files"]
    monkeypatch.chdir(tmp_path)
    assert export_hf(tmp_path, "toy", tmp_path / "out") == 2
    assert one_error_line(capsys) == ("ray-ddp export: error: run toy's model is not a Hugging Face model "
                                      "(its checkpoint has no hf_config.json); use --format torch")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["runs"], "nothing written"


def test_a_changed_hf_config_is_caught_by_its_crc(tmp_path, capsys):
    folder = write_ddp(tmp_path / "runs" / "hf", gpt2())
    path = folder / HF_CONFIG_FILE
    path.write_text(path.read_text().replace('"n_layer": 1', '"n_layer": 2'))  # the same size
    assert verify_checkpoint(str(folder)) == f"{HF_CONFIG_FILE} is corrupt (CRC-32 mismatch)"
    assert export_hf(tmp_path, "hf", tmp_path / "out") == 2
    assert f"{HF_CONFIG_FILE} is corrupt (CRC-32 mismatch)" in one_error_line(capsys)
    assert not (tmp_path / "out").exists()


def rewrite_hf_config(folder, **changes):
    """hf_config.json changed, and meta.json to match: whoever writes the storage can do both."""
    fields = json.loads((folder / HF_CONFIG_FILE).read_text())
    (folder / HF_CONFIG_FILE).write_text(json.dumps({**fields, **changes}))
    meta = json.loads((folder / META_FILE).read_text())
    meta["files"][HF_CONFIG_FILE] = file_fingerprint(str(folder / HF_CONFIG_FILE))
    (folder / META_FILE).write_text(json.dumps(meta))


@pytest.mark.parametrize("changes, fragment", [
    # a transformers callable, but no model class: only the name is looked up, nothing runs
    ({"architectures": ["pipeline"]}, "names architecture ['pipeline'], which is no model class of "
                                      "transformers"),
    ({"n_layer": 2}, "does not fit the GPT2LMHeadModel its hf_config.json describes: Missing key(s)"),
])
def test_a_config_that_does_not_build_this_model_is_one_line(tmp_path, capsys, changes, fragment):
    rewrite_hf_config(write_ddp(tmp_path / "runs" / "hf", gpt2()), **changes)
    assert export_hf(tmp_path, "hf", tmp_path / "out") == 2
    assert fragment in one_error_line(capsys)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["runs"], "nothing written"


def test_a_model_bigger_than_max_shard_size_is_written_in_shards_with_their_index(tmp_path, capsys):
    """As save_pretrained shards a big model: model-0000N-of-0000M.safetensors and
    model.safetensors.index.json naming each tensor's file; from_pretrained loads it."""
    model = nudged(gpt2())  # ~60 KB of weights in files of at most 20 KB: several
    write_ddp(tmp_path / "runs" / "hf", model)
    out = tmp_path / "sharded"
    assert main(["export", "hf", "--storage", str(tmp_path / "runs"), "--format", "hf", "--out", str(out),
                 "--max-shard-size", "20KB"]) == 0
    names = sorted(os.listdir(out))
    shards = [n for n in names if n.startswith("model-") and n.endswith(".safetensors")]
    assert len(shards) > 1 and shards[-1].endswith(f"-of-{len(shards):05d}.safetensors"), names
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == set(shards)
    assert "model.safetensors" not in names
    assert capsys.readouterr().out.strip().endswith(f"({', '.join(names)})")
    loaded = transformers.AutoModelForCausalLM.from_pretrained(str(out), local_files_only=True)
    assert_same_weights(loaded, model.state_dict())


@pytest.mark.parametrize("size, fragment", [("5 GB", "--max-shard-size 5 GB: give a whole number and a unit"),
                                            ("lots", "give a whole number and a unit, e.g. 5GB")])
def test_a_max_shard_size_that_is_no_size_is_one_line(tmp_path, capsys, size, fragment):
    write_ddp(tmp_path / "runs" / "hf", gpt2())
    assert main(["export", "hf", "--storage", str(tmp_path / "runs"), "--format", "hf", "--out",
                 str(tmp_path / "out"), "--max-shard-size", size]) == 2
    assert fragment in one_error_line(capsys)
    assert main(["export", "hf", "--storage", str(tmp_path / "runs"), "--max-shard-size", "5GB"]) == 2
    assert "--max-shard-size sizes the safetensors files of --format hf" in one_error_line(capsys)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["runs"], "nothing written"


@pytest.mark.parametrize("case", ["no --out", "out not empty", "out is a file", "no transformers"])
def test_hf_export_mistakes_are_one_line_and_exit_2(tmp_path, capsys, monkeypatch, case):
    write_ddp(tmp_path / "runs" / "hf", gpt2())
    out = tmp_path / "out"
    argv = ["export", "hf", "--storage", str(tmp_path / "runs"), "--format", "hf", "--out", str(out)]
    if case == "no --out":
        argv, fragment = argv[:-2], "--format hf needs --out DIR"
    elif case == "out not empty":
        out.mkdir()
        (out / "keep.txt").write_text("mine")
        fragment = "is a folder that is not empty; name a new or empty one"
    elif case == "out is a file":
        out.write_text("mine")
        fragment = "is a file; --format hf writes a folder"
    else:
        monkeypatch.setitem(sys.modules, "transformers", None)  # `import transformers` fails
        fragment = "pip install ray_ddp[hf]"
    assert main(argv) == 2
    assert fragment in one_error_line(capsys)
    if case == "out not empty":
        assert os.listdir(out) == ["keep.txt"]
    elif case == "out is a file":
        assert out.read_text() == "mine"
    else:
        assert not out.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["runs"] + (["out"] if out.exists() else []))


def test_an_empty_out_folder_is_filled_and_a_failed_save_leaves_nothing(tmp_path, monkeypatch):
    write_ddp(tmp_path / "runs" / "hf", gpt2())
    (tmp_path / "empty").mkdir()
    assert export_hf(tmp_path, "hf", tmp_path / "empty") == 0
    assert "model.safetensors" in os.listdir(tmp_path / "empty")

    def fails_halfway(self, directory, **kw):
        (open(os.path.join(directory, "config.json"), "w")).close()
        raise OSError("disk full")

    monkeypatch.setattr(transformers.GPT2LMHeadModel, "save_pretrained", fails_halfway)
    with pytest.raises(OSError, match="disk full"):
        export_hf(tmp_path, "hf", tmp_path / "out")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty", "runs"], "nothing half-written"


def test_storage_that_is_not_the_local_disk_copies_the_config_too(tmp_path, monkeypatch):
    """As from s3://: the checkpoint's files are fetched into a temporary folder first."""
    from flaky_fs import FlakyHandler

    import ray_ddp.export.run as export
    from ray_ddp.storage import Storage

    model = nudged(gpt2())
    write_ddp(tmp_path / "runs" / "hf", model)
    remote = Storage(uri="flaky://runs", fs=pafs.PyFileSystem(FlakyHandler(fail_opens=0)),
                           path=str(tmp_path / "runs"))
    monkeypatch.setattr(export, "resolve_storage", lambda storage: remote)
    summary = export.export_model("hf", "flaky://runs", out=str(tmp_path / "out"), format="hf")
    assert summary.architecture == "GPT2LMHeadModel" and not summary.sharded
    loaded = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"), local_files_only=True)
    assert_same_weights(loaded, model.state_dict())


LORA = "r=2,alpha=4,targets=c_attn"


def lora_run(tmp_path, started_from, flag=None, spec=LORA):
    """A --lora GPT-2 run's checkpoint (base and adapters moved off their init, as an
    --init-from base and training leave them), and the adapted model it holds.
    ``started_from``: the weights the run started from; ``flag``: the --init-from of the
    command that wrote this checkpoint (a resume ignores it)."""
    from ray_ddp.models.lora import apply_lora

    model = nudged(apply_lora(gpt2(), spec, "the tiny GPT-2")).eval()
    config = {"model": "hf:/models/gpt2", "lora": spec, **({"init_from": flag} if flag else {})}
    write_ddp(tmp_path / "runs" / "lora", model, config, started_from)
    return model


def written_counts(line):
    """The tensors and values an export's line says it wrote."""
    tensors, values = line.split(": ", 1)[1].split(" -> ")[0].split(", ")
    return int(tensors.split()[0]), int(values.split()[0].replace(",", ""))


def test_a_lora_run_started_from_other_weights_exports_merged_or_is_refused_in_one_line(tmp_path, capsys):
    """The adapters alone name hf:DIR as their base; a run that started --init-from other
    weights trained them over those. So its hf export is refused without --merge (nothing
    written), and with --merge it is the whole adapted model: a plain from_pretrained
    folder, no peft, whose forward is the run's model's."""
    pytest.importorskip("peft")
    model = lora_run(tmp_path, "/runs/pretrain/step-00000050", flag="/runs/pretrain/step-00000050")
    out = tmp_path / "out"
    argv = ["export", "lora", "--storage", str(tmp_path / "runs"), "--format", "hf", "--out", str(out)]
    assert main(argv) == 2
    line = one_error_line(capsys)
    assert "over its --init-from weights (/runs/pretrain/step-00000050)" in line and "pass --merge" in line
    assert not out.exists()

    assert main(argv + ["--merge"]) == 0
    line = capsys.readouterr().out
    assert "its LoRA adapters merged into the base" in line
    assert not any(name.startswith("adapter_") for name in os.listdir(out))
    saved = load_file(str(out / "model.safetensors"))  # the tied lm_head once, as save_pretrained writes it
    assert written_counts(line) == (len(saved), sum(t.numel() for t in saved.values()))
    loaded = transformers.AutoModelForCausalLM.from_pretrained(str(out), local_files_only=True).eval()
    assert type(loaded).__name__ == "GPT2LMHeadModel" and not any(".lora_" in k for k in loaded.state_dict())
    ids = torch.randint(0, 64, (2, 8))
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=ids).logits, model(input_ids=ids).logits,
                                   rtol=1e-5, atol=1e-5)


def test_a_resumed_lora_run_is_judged_by_where_its_first_life_started_not_its_last_command(tmp_path, capsys):
    """A resume ignores --init-from: the run that started from other weights and was resumed
    without the flag is refused still; one whose resume was given an ignored flag is not."""
    pytest.importorskip("peft")
    lora_run(tmp_path, "/runs/pretrain/step-00000050", flag=None)
    assert export_hf(tmp_path, "lora", tmp_path / "out") == 2
    assert "(/runs/pretrain/step-00000050)" in one_error_line(capsys)


@pytest.mark.parametrize("flag", [None, "/runs/pretrain/step-00000050"])
def test_a_lora_run_from_hf_dirs_own_weights_exports_its_adapters(tmp_path, capsys, flag):
    pytest.importorskip("peft")
    lora_run(tmp_path, None, flag=flag)
    capsys.readouterr()
    assert export_hf(tmp_path, "lora", tmp_path / "out") == 0
    assert {"adapter_config.json", "adapter_model.safetensors"} <= set(os.listdir(tmp_path / "out"))
    saved = load_file(str(tmp_path / "out" / "adapter_model.safetensors"))
    assert saved and all("lora_" in k for k in saved)
    assert written_counts(capsys.readouterr().out) == (len(saved), sum(t.numel() for t in saved.values()))


def test_an_adapter_on_a_tied_weight_exports_alone_and_merging_it_is_one_line(tmp_path, capsys):
    """GPT-2's lm_head is its token embedding: its adapters export as peft loads them over
    the base, but merged, the adapter would change both."""
    peft = pytest.importorskip("peft")
    model = lora_run(tmp_path, None, spec="r=2,alpha=4,targets=c_attn,lm_head")
    assert export_hf(tmp_path, "lora", tmp_path / "adapters") == 0
    base = gpt2()
    base.load_state_dict({k.removeprefix("base_model.model.").replace(".base_layer", ""): v
                          for k, v in model.state_dict().items() if ".lora_" not in k}, strict=False)
    loaded = peft.PeftModel.from_pretrained(base, str(tmp_path / "adapters")).eval()
    ids = torch.randint(0, 64, (2, 8))
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=ids).logits, model(input_ids=ids).logits, rtol=1e-5, atol=1e-5)
    out = tmp_path / "out"
    assert main(["export", "lora", "--storage", str(tmp_path / "runs"), "--format", "hf", "--out", str(out),
                 "--merge"]) == 2
    line = one_error_line(capsys)
    assert "adapters on base_model.model.lm_head: its weight is also" in line and "wte.weight" in line
    assert not out.exists()


@pytest.mark.parametrize("case", ["not a --lora run", "--format torch"])
def test_merge_where_there_is_nothing_to_merge_is_one_line(tmp_path, capsys, case):
    write_ddp(tmp_path / "runs" / "hf", gpt2())
    argv = ["export", "hf", "--storage", str(tmp_path / "runs"), "--merge", "--out", str(tmp_path / "out")]
    if case == "not a --lora run":
        argv, fragment = argv + ["--format", "hf"], "was not trained with --lora: drop --merge"
    else:
        fragment = "pass it with --format hf"
    assert main(argv) == 2
    assert fragment in one_error_line(capsys)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["runs"], "nothing written"


def test_where_a_run_started_is_planned_for_its_workers_across_resumes():
    """The driver plans each life's record of where the run started: a new run's
    --init-from; a resumed or restarted one's checkpoint's, whatever its command says."""
    from ray_ddp.checkpoint.verify import CheckpointScan
    from ray_ddp.config.train import TrainConfig
    from ray_ddp.driver.fit import plan_workers
    from ray_ddp.driver.resolve import resolve

    run = resolve(TrainConfig(), None)
    assert plan_workers(run, CheckpointScan(), {}, init_from="/a/step-5").started_from == "/a/step-5"
    resumed = CheckpointScan(latest=STEP, meta={"epoch": 1, "step": 10, "started_from": "/a/step-5",
                                                "config": {}})
    assert plan_workers(run, resumed, {}, init_from=None).started_from == "/a/step-5"
    # a checkpoint from before started_from was recorded: its command's --init-from
    older = CheckpointScan(latest=STEP, meta={"epoch": 1, "step": 10, "config": {"init_from": "/b"}})
    assert plan_workers(run, older, {}).started_from == "/b"
    assert plan_workers(run, CheckpointScan(latest=STEP, meta={"epoch": 1, "step": 10, "config": {},
                                                               "started_from": None}), {}).started_from is None


def test_max_shard_size_of_a_lora_runs_adapters_alone_is_one_line(tmp_path, capsys):
    """peft writes the adapters in one file of its own, whatever the size asked: said, not
    ignored; with --merge the whole model is written in shards."""
    lora_run(tmp_path, started_from=None)
    argv = ["export", "lora", "--storage", str(tmp_path / "runs"), "--format", "hf", "--max-shard-size", "20KB"]
    assert main([*argv, "--out", str(tmp_path / "adapters")]) == 2
    assert "--max-shard-size: a --lora run's adapters are written whole" in one_error_line(capsys)
    assert not (tmp_path / "adapters").exists()
    assert main([*argv, "--out", str(tmp_path / "merged"), "--merge"]) == 0
    assert (tmp_path / "merged" / "model.safetensors.index.json").exists()
