"""Hugging Face models as people bring them (built from configs: nothing is downloaded):
a GPT-2 with its own loss, a BERT classifier from a save_pretrained folder through
``--model hf:DIR`` on padded dict batches (on Ray workers, with --keep-best), ``--init-from``,
``--format hf`` export, and LoRA's run, which also holds the exactness of a model's own
loss over ranks and accumulation steps on ragged rows (against one plain process). All but
BERT's run are ray_ddp's own code, in plain gloo processes (tests/helpers/gloo_run.py)."""

from __future__ import annotations

import json
import math
import os

import pyarrow.parquet as pq
import pytest
import torch

from ray_ddp import TrainConfig, run
from ray_ddp.checkpoint.format import META_FILE, MODEL_FILE
from ray_ddp.driver.resolve import resolve
from gloo_run import train_in_gloo

pytest.importorskip("transformers")  # the [hf] extra; .ci/run installs it with [test]
pytestmark = pytest.mark.ray


def train_in_one_process(model, data, collate, epochs: int, steps: int, rows: int, lr: float) -> dict:
    """The single-process reference of a run with the default seed: ray_ddp's SGD
    (momentum 0.9, the trainable parameters, no clipping) taking the model's own loss
    over each whole step of ``rows`` rows, in the run's epoch order; its weights after."""
    from ray_ddp.data.sources import epoch_order

    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=lr, momentum=0.9)
    for epoch in range(epochs):
        order = epoch_order(len(data), 0, epoch)
        for step in range(steps):
            batch, _ = collate([data[int(i)] for i in order[step * rows:(step + 1) * rows]])
            model(**batch).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
    return model.state_dict()


def _local(checkpoint_uri: str) -> str:
    return checkpoint_uri[len("file://"):] if checkpoint_uri.startswith("file://") else checkpoint_uri


@pytest.fixture(scope="module")
def gpt2_run(storage):
    """The issue's user: GPT2LMHeadModel from a GPT2Config, items ({input_ids, labels}, ids),
    no loss= given: the model's own loss is the objective. ray_ddp's own loop, in plain gloo
    processes (an HF model in Ray workers: the BERT run)."""
    from hf_data import CausalText, gpt2

    cfg = TrainConfig(workers=2, epochs=4, batch_size=16, optimizer="adamw", lr=3e-3, report_every=10,
                      storage=str(storage), name="hf-gpt2", quiet=True)
    return train_in_gloo(cfg, model=gpt2, train_data=CausalText(640, seed=0), val_data=CausalText(128, seed=1))


def test_a_gpt2_trains_on_its_own_loss_far_below_a_unigram_model(gpt2_run):
    from hf_data import VOCAB, CausalText

    assert gpt2_run.task == "lm" and gpt2_run.epochs_completed == 4
    train, val = CausalText(640, seed=0).seqs, CausalText(128, seed=1).seqs
    freq = torch.bincount(train[:, 1:].flatten(), minlength=VOCAB).double() + 1
    unigram = math.exp(-(freq / freq.sum()).log()[val[:, 1:].flatten()].mean().item())
    assert gpt2_run.val_perplexity < 0.5 * unigram, (gpt2_run.val_perplexity, unigram)


def test_init_from_starts_where_another_run_ended(gpt2_run, storage):
    from hf_data import CausalText, gpt2

    cfg = TrainConfig(workers=1, epochs=1, steps_per_epoch=2, batch_size=32, optimizer="adamw", lr=1e-4,
                      report_every=1, storage=str(storage), name="hf-gpt2-init", quiet=True,
                      init_from=_local(gpt2_run.checkpoint))
    # ray_ddp's own loading of the weights (models/init.py), in a plain gloo process, no Ray
    summary = train_in_gloo(cfg, model=gpt2, train_data=CausalText(64, seed=0), val_data=CausalText(128, seed=1))
    # a fresh GPT-2 starts near ln(64) = 4.2; this one starts where the other ended
    assert summary.val_loss < gpt2_run.val_loss + 0.1 and summary.val_loss < 3.0
    # and its checkpoints say so (what a --lora run's export asks: export/run.py)
    with open(os.path.join(_local(summary.checkpoint), META_FILE)) as f:
        assert json.load(f)["started_from"] == cfg.init_from
    lines = []
    again = run(cfg, echo=lines.append, model=gpt2, train_data=CausalText(64, seed=0),
                val_data=CausalText(128, seed=1))
    assert again.already_complete
    assert any("--init-from" in line and "is ignored" in line for line in lines), lines


def test_export_hf_gives_a_folder_from_pretrained_loads(gpt2_run, storage, tmp_path):
    from transformers import AutoModelForCausalLM

    from ray_ddp.cli.main import main

    out = tmp_path / "gpt2-export"
    assert main(["export", "hf-gpt2", "--storage", str(storage), "--format", "hf", "--out", str(out)]) == 0
    model = AutoModelForCausalLM.from_pretrained(str(out), local_files_only=True)
    trained = torch.load(os.path.join(_local(gpt2_run.checkpoint), MODEL_FILE), weights_only=True)
    for key, value in model.state_dict().items():
        torch.testing.assert_close(value, trained[key], rtol=0, atol=0)


def test_a_bert_folder_learns_from_a_datasets_dataset_padded_by_its_tokenizers_collator(ray_local, storage,
                                                                                          tmp_path):
    # data as Hugging Face users hold it: dict rows of ragged ids with a `label` column,
    # the training rows a save_to_disk folder given as --data DIR (read by pyarrow), the
    # validation rows a datasets.Dataset given as val_data=; DataCollatorWithPadding
    # (tokenizer) as the collate object; the rows' labels make the model's own loss the
    # objective. The model is a save_pretrained folder given as --model hf:DIR. (Module
    # paths for --dataset and --collate: test_recovery.py's user model; pad_sequences:
    # the LoRA run below.) It keeps the newest checkpoint and the best (--keep 1
    # --keep-best): ray_ddp prunes, Ray's own retention stays off and deletes neither. One
    # validation row in 10 has a wrong label: as the model grows sure of the right ones,
    # those rows' loss grows, so the best checkpoint is an early one, not the newest.
    from transformers import DataCollatorWithPadding

    from hf_data import bert, sentiment_rows, tokenizer

    bert().save_pretrained(str(tmp_path / "bert"))
    sentiment_rows(480, seed=0).save_to_disk(str(tmp_path / "train"))
    cfg = TrainConfig(model=f"hf:{tmp_path / 'bert'}", workers=2, epochs=6, batch_size=16, optimizer="adamw",
                      lr=3e-3, report_every=10, data=str(tmp_path / "train"), storage=str(storage), name="hf-bert",
                      keep=1, keep_best=True, quiet=True)
    val = sentiment_rows(120, seed=1).map(lambda row, i: {"label": (row["label"] + 1) % 3 if i % 10 == 0
                                                       else row["label"]}, with_indices=True)
    summary = run(cfg, val_data=val, collate=DataCollatorWithPadding(tokenizer()))
    assert summary.steps == 6 * 15  # 480 rows at 2 x 16 a step
    assert summary.task == "classification"
    assert 0.8 < summary.val_accuracy <= 0.9, summary.val_accuracy  # chance is 1/3; 12 rows mislabelled
    evals = pq.read_table(f"{summary.path}/eval.parquet").to_pylist()
    best = min(evals, key=lambda r: r["loss"])["step"]
    kept = sorted(p.name for p in (storage / "hf-bert").glob("step-*"))
    assert best < 90 and kept == [f"step-{best:08d}", "step-00000090"], (kept, evals)
    assert summary.best_checkpoint == f"{summary.path}/step-{best:08d}"


def test_lora_trains_only_its_adapters_resumes_exactly_and_exports_what_peft_loads(storage, tmp_path):
    """--lora on an hf:DIR GPT-2 under FSDP, on ragged rows padded with -100, 2 workers x
    16 rows x 2 accumulation steps (a global batch of 64): 1 epoch, then the same command
    resumed to 2. The model's own loss is exact over ranks and accumulation: its adapters
    end as one plain process's that trains the same adapters (the same build_model, so the
    same first adapters) on the model's loss over each whole 64-row step of the run's
    epoch order, to float rounding, where a mean of the micro-batches' means (what an
    unweighted HF loss gives) differs by percents of what training changed. The base
    weights never move; export --format hf writes the adapters as PeftModel.from_pretrained
    loads them over the base. All of it is ray_ddp's own code, so both commands train in
    plain gloo processes (tests/helpers/gloo_run.py). (Every head's loss, DDP and FSDP,
    each cut against one plain process: test_loss_matrix.py.)"""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from hf_data import CausalText, gpt2
    from ray_ddp.cli.main import main
    from ray_ddp.data.collate import pad_sequences
    from ray_ddp.models.build import build_model

    base = tmp_path / "base"
    gpt2(1).save_pretrained(str(base))
    data = CausalText(192, seed=3, ragged=True)  # 3 steps of 64 rows an epoch

    def config(epochs):
        return TrainConfig(model=f"hf:{base}", lora="r=4,alpha=8,targets=c_attn", strategy="fsdp", workers=2,
                           batch_size=16, global_batch=64, epochs=epochs, optimizer="sgd", lr=0.05,
                           report_every=3, collate="ray_ddp.data.collate:pad_sequences",
                           storage=str(storage), name="hf-lora", quiet=True)

    assert train_in_gloo(config(1), train_data=data).epochs_completed == 1
    resumed = train_in_gloo(config(2), train_data=data)
    assert resumed.resumed_from.endswith("step-00000003") and resumed.epochs_completed == 2
    trained = torch.load(os.path.join(_local(resumed.checkpoint), MODEL_FILE), weights_only=True)

    torch.manual_seed(0)  # the run's seed, as a worker sets it before building the model
    model = build_model(resolve(config(2), None), [torch.device("cpu")])
    start = {k: v.clone() for k, v in model.state_dict().items()}
    want = train_in_one_process(model, data, pad_sequences, epochs=2, steps=3, rows=64, lr=0.05)
    adapters = [k for k in want if ".lora_" in k]
    assert adapters and set(trained) == set(want)
    for key, value in want.items():
        if key in adapters:
            moved = (value - start[key]).norm()
            assert moved > 0 and (trained[key] - value).norm() <= 1e-3 * moved + 1e-6, key
        else:
            assert torch.equal(trained[key], start[key]), f"{key}: a frozen base weight moved"

    out = tmp_path / "adapters"
    assert main(["export", "hf-lora", "--storage", str(storage), "--format", "hf", "--out", str(out)]) == 0
    assert {"adapter_config.json", "adapter_model.safetensors"} <= set(os.listdir(out))
    loaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(str(base)), str(out)).state_dict()
    for key in adapters:
        torch.testing.assert_close(loaded[key], trained[key], rtol=0, atol=0)


def test_fsdp_validation_of_a_gpt2_whose_rows_leave_a_rank_an_empty_last_batch(storage):
    """33 validation rows on 2 ranks in batches of 16: rank 0 holds 16 rows in one batch,
    rank 1 17 in two, and FSDP's forward is a collective, so rank 0 runs a second batch
    with no rows. A GPT-2 cannot reshape 0 rows: the rank runs a real row in its place and
    counts nothing of it, so every validation row counts once, on its own rank."""
    from hf_data import CausalText, gpt2

    cfg = TrainConfig(workers=2, strategy="fsdp", epochs=1, steps_per_epoch=2, batch_size=16,
                      storage=str(storage), name="hf-fsdp-val", quiet=True)
    val = CausalText(33, seed=1)
    summary = train_in_gloo(cfg, model=gpt2, train_data=CausalText(64, seed=0), val_data=val)
    with torch.no_grad():  # the figure over the 33 rows, in one process: each counted once
        model = gpt2()
        model.load_state_dict(torch.load(os.path.join(_local(summary.checkpoint), MODEL_FILE), weights_only=True))
        ids = val.seqs
        want = model(input_ids=ids, labels=ids).loss.item()
    assert summary.val_loss == pytest.approx(want, rel=1e-4)
