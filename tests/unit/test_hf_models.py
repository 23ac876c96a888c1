"""Models as the field writes them, without Ray: the calling convention (a dict batch as
keyword arguments), outputs of every shape, a model's own loss weighted by its units,
-100 padding, the padding collate, --init-from, hf:DIR, and the one-line refusals."""

from __future__ import annotations

import collections
import os
import sys

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

from ray_ddp.config.train import TrainConfig
from ray_ddp.data.collate import pad_sequences
from ray_ddp.data.plan import inspect_data
from ray_ddp.errors import BatchError, ConfigError
from ray_ddp.models.build import check_model
from ray_ddp.models.init import apply_init_weights, read_init_weights
from ray_ddp.tasks.batches import forward, logits_of, loss_of
from ray_ddp.tasks.build import build_task
from ray_ddp.driver.resolve import resolve

transformers = pytest.importorskip("transformers")
HELPERS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "helpers")
sys.path.insert(0, HELPERS)


class Keywords(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, 4)

    def forward(self, input_ids, attention_mask=None):
        h = self.emb(input_ids)
        return h * attention_mask[..., None] if attention_mask is not None else h


class Whole(nn.Module):
    def forward(self, batch):
        return batch["x"] * 2


class TwoArgs(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Linear(3, 3)

    def forward(self, a, b):
        return self.w(a + b)


def test_a_dict_goes_as_keywords_when_the_forward_names_its_keys_else_whole():
    batch = {"input_ids": torch.tensor([[1, 2]]), "attention_mask": torch.tensor([[1, 0]])}
    out = forward(Keywords(), batch)
    assert out.shape == (1, 2, 4) and out[0, 1].abs().sum() == 0  # the mask reached the forward
    assert torch.equal(forward(Whole(), {"x": torch.ones(2)}), torch.full((2,), 2.0))
    with pytest.raises(BatchError, match="takes a, b"):
        forward(TwoArgs(), {"input_ids": torch.ones(1)})


def test_logits_and_loss_come_from_every_kind_of_output():
    t = torch.randn(2, 3)
    Out = collections.namedtuple("Out", "logits hidden")
    hf = transformers.modeling_outputs.SequenceClassifierOutput(loss=torch.tensor(1.5), logits=t)
    for output in (t, (t, None), Out(t, None), {"logits": t}, hf):
        assert logits_of(output) is t
    assert loss_of(hf).item() == 1.5 and loss_of({"logits": t}) is None and loss_of(t) is None
    task = build_task("classification")
    assert task.sums(hf, torch.tensor([0, 1]))["units"] == 2.0  # the logits of a ModelOutput


def test_the_lm_task_ignores_minus_100_in_the_loss_and_the_units():
    logits = torch.randn(1, 4, 5)
    target = torch.tensor([[1, 2, -100, -100]])
    sums = build_task("lm", 4).sums(logits, target)
    expected = nn.functional.cross_entropy(logits[0, :2], target[0, :2], reduction="sum")
    assert sums["loss"].item() == pytest.approx(expected.item()) and float(sums["units"]) == 2.0


def test_a_causal_lms_own_loss_is_weighted_by_its_shifted_label_tokens():
    from hf_data import gpt2

    model = gpt2(1)
    x, y = pad_sequences([({"input_ids": torch.arange(6), "labels": torch.arange(6)}, torch.arange(6)),
                          ({"input_ids": torch.arange(3), "labels": torch.arange(3)}, torch.arange(3))])
    task = build_task("lm", 6, model=model, model_loss=True)
    assert task.variable_units and task.count_units(x, y) == (6 - 1) + (3 - 1)
    out = forward(model, x)
    sums = task.sums(out, y, x)
    assert sums["loss"].item() == pytest.approx(out.loss.item() * 7, rel=1e-6)


def test_a_sequence_classifiers_own_loss_is_a_mean_over_rows():
    from hf_data import bert

    task = build_task("classification", model=bert(), model_loss=True)
    x = {"input_ids": torch.ones(3, 5, dtype=torch.long), "labels": torch.tensor([0, 1, 2])}
    assert not task.variable_units and task.count_units(x, torch.tensor([0, 1, 2])) == 3.0


def test_pad_sequences_pads_ids_masks_and_labels():
    x, y = pad_sequences([({"input_ids": torch.tensor([5, 6, 7]), "labels": torch.tensor([5, 6, 7])},
                           torch.tensor([5, 6, 7])),
                          ({"input_ids": torch.tensor([8]), "labels": torch.tensor([8])}, torch.tensor([8]))])
    assert x["input_ids"].tolist() == [[5, 6, 7], [8, 0, 0]]
    assert x["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]
    assert x["labels"].tolist() == [[5, 6, 7], [8, -100, -100]] and y.tolist() == x["labels"].tolist()
    _, labels = pad_sequences([(torch.tensor([1, 2]), torch.tensor(1)), (torch.tensor([3]), torch.tensor(0))])
    assert labels.tolist() == [1, 0]


def test_init_from_loads_matching_keys_and_names_the_rest(tmp_path):
    from hf_data import gpt2

    trained = gpt2(1)
    with torch.no_grad():
        trained.transformer.wte.weight.add_(1.0)
    trained.save_pretrained(str(tmp_path / "hf"))  # drops the tied lm_head: not "missing"
    fresh = gpt2(1)
    apply_init_weights(fresh, str(tmp_path / "hf"), True)
    assert torch.equal(fresh.transformer.wte.weight, trained.transformer.wte.weight)
    torch.save({"head.weight": torch.zeros(2, 2)}, tmp_path / "other.pt")
    with pytest.raises(ConfigError, match=r"does not fit the model: .*missing: transformer\..*unexpected: "
                                          r"head.weight.*--init-strict false"):
        apply_init_weights(gpt2(1), str(tmp_path / "other.pt"), True)
    apply_init_weights(gpt2(1), str(tmp_path / "other.pt"), False)
    (tmp_path / "notes.pt").write_bytes(b"not a torch file")
    with pytest.raises(ConfigError, match="not a state_dict that loads with weights_only=True"):
        read_init_weights(str(tmp_path / "notes.pt"))


def test_the_drivers_check_reads_names_and_shapes_never_the_weights(tmp_path):
    from hf_data import gpt2

    from ray_ddp.models.init import check_init_weights

    trained = gpt2(1)
    trained.save_pretrained(str(tmp_path / "hf"))
    torch.save(trained.state_dict(), tmp_path / "whole.pt")
    for given in (str(tmp_path / "hf"), str(tmp_path / "whole.pt")):
        shapes = read_init_weights(given, shapes_only=True)
        whole = read_init_weights(given)
        assert set(shapes) == set(whole) and all(t.device.type == "meta" for t in shapes.values())
        assert all(shapes[k].shape == whole[k].shape for k in whole)
        check_init_weights(gpt2(1), shapes, True, given)  # fits, as the weights do
    bigger = gpt2(1)
    bigger.transformer.wte = torch.nn.Embedding(trained.config.vocab_size + 1, trained.config.n_embd)
    with pytest.raises(ConfigError, match=r"shapes differ: transformer\.wte\.weight"):
        check_init_weights(bigger, read_init_weights(str(tmp_path / "hf"), shapes_only=True), True, "hf")


def test_the_driver_refuses_what_no_task_can_use(tmp_path):
    class Keyed(torch.utils.data.Dataset):
        def __len__(self):
            return 8

        def __getitem__(self, i):
            return {"input_ids": torch.ones(3, dtype=torch.long)}, torch.tensor(0)

    cfg = TrainConfig(storage=str(tmp_path), model="python:m").validate()
    with pytest.raises(ConfigError, match="takes a, b"):
        check_model(resolve(cfg, None), TwoArgs, inspect_data(cfg, Keyed()).example)

    class NoLogits(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Linear(3, 2)

        def forward(self, x):
            return {"hidden": None}

    with pytest.raises(ConfigError, match="no logits and no loss"):
        check_model(resolve(cfg, None), NoLogits, inspect_data(cfg, TensorDataset(torch.randn(8, 3), torch.randn(8, 2))).example)


def test_hf_dir_without_config_json_is_one_line_and_without_transformers_names_the_extra(tmp_path, capsys,
                                                                                         monkeypatch):
    """The CLI's own path, in this process (a real process's one line: test_cli_errors.py)."""
    from ray_ddp.cli.main import main

    (tmp_path / "empty").mkdir()
    argv = ["train", "--model", f"hf:{tmp_path / 'empty'}", "--storage", f"{tmp_path}/runs"]
    assert main(argv) == 2
    assert "has no config.json" in capsys.readouterr().err
    monkeypatch.setitem(sys.modules, "transformers", None)  # `import transformers` now fails
    assert main(argv) == 2
    assert "pip install 'ray_ddp[hf]'" in capsys.readouterr().err
    assert not (tmp_path / "runs").exists()


def test_hf_dir_and_init_from_read_a_folder_on_the_runs_storage_by_uri(tmp_path):
    from hf_data import bert

    from ray_ddp.models.hf import build_hf_model

    saved = bert()
    saved.save_pretrained(str(tmp_path / "bert"))
    uri = f"file://{tmp_path / 'bert'}"
    model = build_hf_model(f"hf:{uri}", torch.device("cpu"))
    assert type(model).__name__ == "BertForSequenceClassification"
    for key, value in saved.state_dict().items():
        assert torch.equal(model.state_dict()[key], value), key
    assert set(read_init_weights(uri)) <= set(saved.state_dict())


def test_the_driver_reads_a_uris_config_and_headers_never_copying_the_weights(tmp_path, monkeypatch):
    import torch.distributed.checkpoint as dcp
    from hf_data import bert

    from ray_ddp.models.hf import build_hf_model, check_hf_folder

    cache = tmp_path / "cache"  # where a node's copies go (models/hf.py node_copy)
    monkeypatch.setenv("RAY_DDP_HF_CACHE", str(cache))
    saved = bert()
    saved.save_pretrained(str(tmp_path / "bert"))
    saved.save_pretrained(str(tmp_path / "split"), max_shard_size="20KB")  # model-0000k-of-0000n.safetensors
    assert len(list((tmp_path / "split").glob("model-*.safetensors"))) > 1
    dcp.save({"model": {"w": torch.ones(2, 3)}}, checkpoint_id=str(tmp_path / "shards"))  # an FSDP checkpoint's form
    torch.save(saved.state_dict(), tmp_path / "whole.pt")

    check_hf_folder(f"hf:file://{tmp_path / 'bert'}")
    meta = build_hf_model(f"hf:file://{tmp_path / 'bert'}", torch.device("meta"))
    assert type(meta).__name__ == "BertForSequenceClassification"
    with pytest.raises(ConfigError, match="has no config.json"):
        check_hf_folder(f"hf:file://{tmp_path / 'shards'}")
    want = {k: tuple(v.shape) for k, v in saved.state_dict().items()}
    for folder in ("bert", "split", "bert/model.safetensors"):
        shapes = read_init_weights(f"file://{tmp_path / folder}", shapes_only=True)
        assert all(t.device.type == "meta" for t in shapes.values())
        assert {k: tuple(v.shape) for k, v in shapes.items()} == {k: want[k] for k in shapes} and \
            set(shapes) <= set(want) and len(shapes) >= len(want) - 1, folder  # (one tied weight saved once)
    assert {k: tuple(v.shape) for k, v in read_init_weights(f"file://{tmp_path / 'shards'}",
                                                             shapes_only=True).items()} == {"w": (2, 3)}
    assert not cache.exists(), "the driver copied a folder to check it"
    # a torch file has no header to read: that one file is copied, memory-mapped
    assert {k: tuple(v.shape) for k, v in read_init_weights(f"file://{tmp_path / 'whole.pt'}",
                                                            shapes_only=True).items()} == want
    with pytest.raises(ConfigError, match="no such file or folder"):
        read_init_weights(f"file://{tmp_path / 'nothing'}", shapes_only=True)


def test_a_file_in_a_uris_folder_keeps_the_query_after_its_path():
    from ray_ddp.models.remote import child_uri, uri_name

    uri = "s3://bucket/models/bert?endpoint_override=127.0.0.1:9000&scheme=http"
    assert child_uri(uri, "config.json") == \
        "s3://bucket/models/bert/config.json?endpoint_override=127.0.0.1:9000&scheme=http"
    assert child_uri("gs://b/m/", "model.safetensors") == "gs://b/m/model.safetensors"
    assert uri_name(child_uri(uri, "model.safetensors")) == "model.safetensors"


def test_a_forward_gets_the_keys_it_names_and_a_kwargs_forward_gets_them_all():
    from ray_ddp.tasks.batches import takes_keyword

    class NoLabels(nn.Module):  # computes no loss: labels are the task's target, not its input
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(10, 3)

        def forward(self, input_ids, attention_mask=None):
            return self.emb(input_ids)

    class AnyKeys(nn.Module):
        def forward(self, **kwargs):
            return sorted(kwargs)

    batch = {"input_ids": torch.tensor([[1, 2]]), "attention_mask": torch.ones(1, 2),
             "labels": torch.tensor([[1, 2]]), "text": ["a b"]}
    assert forward(NoLabels(), batch).shape == (1, 2, 3)  # no TypeError for labels or text
    assert not takes_keyword(NoLabels(), "labels")
    assert forward(AnyKeys(), batch) == ["attention_mask", "input_ids", "labels", "text"]
    assert takes_keyword(AnyKeys(), "labels")


def test_hf_dir_of_a_bf16_checkpoint_trains_fp32_weights(tmp_path):
    from hf_data import gpt2

    from ray_ddp.models.hf import build_hf_model

    gpt2(1).to(torch.bfloat16).save_pretrained(str(tmp_path / "bf16"))
    model = build_hf_model(f"hf:{tmp_path / 'bf16'}", torch.device("cpu"))
    assert {p.dtype for p in model.parameters()} == {torch.float32}


def test_an_empty_micro_batch_never_reaches_the_model_and_adds_nothing(one_rank_group):
    """GPT-2 cannot take 0 rows: a step whose second micro-batch is empty runs the rank's
    last real row times 0 instead, under DDP's no_sync and its all-reduce alike."""
    from hf_data import gpt2

    from ray_ddp.config.train import TrainConfig
    from ray_ddp.parallel.build import build_strategy
    from ray_ddp.worker.parts import TrainParts
    from ray_ddp.worker.step import train_step
    from ray_ddp.worker.window import WindowState

    def step(micro_batches):
        model = gpt2(1)
        strategy = build_strategy(TrainConfig(strategy="ddp"))
        wrapped = strategy.setup_module(model, [torch.device("cpu")])
        optimizer = torch.optim.SGD(model.parameters(), lr=0.0)  # lr 0: the gradients are the result
        parts = TrainParts(model, wrapped, wrapped, optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1),
                           torch.amp.GradScaler("cpu", enabled=False), [torch.device("cpu")], strategy)
        source = type("Source", (), {"micro_batch": lambda self, e, s, m: micro_batches[m]})()
        window = WindowState.start(torch.device("cpu"), torch.device("cpu"))
        train_step(parts, build_task("lm", 6, model=model, model_loss=True), source, window, 1, 0,
                   len(micro_batches), 0.0, torch.device("cpu"))
        return {n: p.grad.clone() for n, p in model.named_parameters()}, window

    ids = torch.randint(1, 60, (2, 6))
    full = ({"input_ids": ids, "labels": ids}, ids, 2)
    empty = ({"input_ids": ids[:0], "labels": ids[:0]}, ids[:0], 2)
    with_empty, window = step([full, empty])
    alone, alone_window = step([full])
    assert window.samples == 2  # the stand-in row is not counted
    assert {k: float(v) for k, v in window.sums.items()} == {k: float(v) for k, v in alone_window.sums.items()}
    for name, grad in alone.items():
        torch.testing.assert_close(with_empty[name], grad)


def test_a_batch_encoding_is_moved_to_the_device_like_a_dict():
    from transformers import BatchEncoding

    from ray_ddp.tasks.batches import to_device

    batch = BatchEncoding({"input_ids": torch.ones(2, 3, dtype=torch.long)})
    moved = to_device(batch, torch.device("meta"))  # any device but the one it is on
    assert moved["input_ids"].device.type == "meta"
