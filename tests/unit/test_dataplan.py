"""What the data decides, on the driver, before Ray starts: the task, the sizes, the
validation rows; and one line for data that cannot serve the task asked for (no Ray)."""

import pytest
import torch

from ray_ddp.cli.main import main
from ray_ddp.errors import ConfigError
from ray_ddp.config.train import TrainConfig
from ray_ddp.data.plan import inspect_data
from ray_ddp.driver.resolve import resolve
from ray_ddp.plan import BatchPlan
from ray_ddp.data.table_stats import inspect_table
from ray_ddp.data.tables import load_table
from ray_ddp.data.synth_files import write_synthetic
from ray_ddp.data.inputs import ValSet, split_rows


@pytest.fixture(scope="module")
def sets(tmp_path_factory):
    root = tmp_path_factory.mktemp("sets")
    write_synthetic(str(root / "cls"), rows=500, features=6, targets=1, task="classification", classes=3)
    write_synthetic(str(root / "lm"), rows=40, features=1, targets=1, task="lm", seq_len=16, vocab_size=20)
    write_synthetic(str(root / "reg"), rows=100, features=4, targets=2)
    (root / "text.txt").write_bytes(b"hello world, " * 100)
    return root


def test_an_integer_label_makes_a_classifier_and_its_classes(sets):
    table = inspect_table(str(sets / "cls"), None, None)
    assert (table.task, table.num_classes, table.input_dim) == ("classification", 3, 6)
    x, y = load_table(table)
    assert x.dtype == torch.float32 and y.dtype == torch.int64 and y.shape == (500,)
    asked = TrainConfig(data=str(sets / "cls"), model="mlp", val_fraction=0.2, workers=2).validate()
    plan = resolve(asked, inspect_data(asked))
    assert (plan.task, plan.output_dim, plan.num_classes) == ("classification", 3, 3)
    assert plan.steps_per_epoch == 7  # 400 training rows / (2 x 32)
    # what the data decided is the plan's: the user's config is left as asked
    assert (plan.config.task, plan.config.num_classes) == (None, None) and plan.config == asked
    assert plan.steps_per_epoch == 7


@pytest.mark.parametrize("label, task", [(lambda i: torch.tensor(i % 3), "classification"),
                                         (lambda i: i % 3, "classification"),
                                         (lambda i: torch.tensor([0.5 * i]), "regression"),
                                         (lambda i: torch.arange(4) + i, "lm")])
def test_a_python_datasets_first_label_decides_the_task(label, task):
    # a user's own Dataset object (the Python API): one integer a row is a class label,
    # floats a regression target, a sequence of integers a language model's tokens
    class Items(torch.utils.data.Dataset):
        def __len__(self):
            return 9

        def __getitem__(self, i):
            return torch.randn(6), label(i)

    shape = inspect_data(TrainConfig(model="user:net"), train_data=Items())
    assert (shape.task, shape.rows, shape.input_dim) == (task, 9, 6)


def test_token_sequences_and_text_make_a_language_model(sets):
    shape = inspect_data(TrainConfig(data=str(sets / "lm"), model="gpt", seq_len=16))
    assert (shape.task, shape.rows, shape.num_classes) == ("lm", 40, shape.num_classes)
    assert shape.num_classes <= 20
    x, y = load_table(inspect_table(str(sets / "lm"), None, None, "lm"), seq_len=16)
    assert x.shape == y.shape == (40, 16) and torch.equal(x[:, 1:], y[:, :-1])  # shifted by one
    text = inspect_data(TrainConfig(data=str(sets / "text.txt"), model="gpt", seq_len=10))
    assert (text.task, text.rows) == ("lm", (1300 - 1) // 10)


@pytest.mark.parametrize("cfg, fragment", [
    (dict(data="REG", task="classification"), "--task classification needs one integer label column"),
    (dict(task="lm"), "--task lm needs data"),
    (dict(val_fraction=0.2), "--val-fraction splits --data or --dataset rows"),
    (dict(data="LM", model="gpt", seq_len=64), "the shortest sequence has 17 tokens; --seq-len 64 needs 65"),
    (dict(data="CLS", num_classes=2), "has labels up to 2, more than --num-classes 2 allows"),
])
def test_data_that_cannot_serve_the_task_is_one_line(sets, cfg, fragment):
    cfg = {k: str(sets / {"REG": "reg", "LM": "lm", "CLS": "cls"}[v]) if k == "data" else v
           for k, v in cfg.items()}
    with pytest.raises(ConfigError, match=fragment):
        inspect_data(TrainConfig(**cfg))


def test_a_validation_split_is_fixed_by_the_seed_and_counts_each_row_once():
    train, val = split_rows(101, 0.3, seed=4)
    assert len(val) == 30 and sorted(torch.cat([train, val]).tolist()) == list(range(101))
    assert torch.equal(split_rows(101, 0.3, seed=4)[1], val)
    seen = []
    vs = ValSet(101, lambda idx: (idx, idx))
    for rank in range(3):
        for x, _ in vs.batches(rank, 3, batch_size=8):
            seen += x.tolist()
    assert sorted(seen) == list(range(101))  # no row twice, none left out, no padding


def test_synth_writes_classification_and_lm_sets(tmp_path, capsys):
    assert main(["data", "synth", "--task", "classification", "--classes", "5", "--rows", "50",
                 "--out", str(tmp_path / "c")]) == 0
    assert "wrote 50 rows (10 features, a label of 5 classes)" in capsys.readouterr().out
    assert main(["data", "synth", "--task", "lm", "--seq-len", "8", "--rows", "20",
                 "--out", str(tmp_path / "l")]) == 0
    assert "wrote 20 rows (sequences of 9 tokens of 256)" in capsys.readouterr().out


def test_a_resume_where_the_data_decides_the_steps_may_change_them():
    from ray_ddp.driver.start import check_resumable

    meta = {"config": {"model": "python:Net", "steps_per_epoch": 6}}
    cfg = TrainConfig(model="python:Net", steps_per_epoch=12, name="r")  # another world size
    check_resumable(resolve(cfg, None), meta, "step-00000006", data_decides_steps=True)  # train_data=, --data
    with pytest.raises(ConfigError, match="resume with the same --steps-per-epoch"):
        check_resumable(resolve(cfg, None), meta, "step-00000006", data_decides_steps=False)  # synthetic


def test_a_worker_cuts_the_global_batch_for_the_world_size_it_got():
    elastic = resolve(TrainConfig(workers="1-4", batch_size=64).validate(), None)  # 4 x 64
    assert elastic.batch == BatchPlan(256, 64)
    assert [elastic.batch.cut(w).grad_accum for w in (1, 2, 3, 4)] == [4, 2, 2, 1]
    assert [elastic.batch.cut(w).micro_rows for w in (1, 2, 3, 4)] == [64, 64, 43, 64]
    # without --global-batch: the largest world x batch x accumulation, cut back at that world
    plain = resolve(TrainConfig(workers=3, batch_size=16, grad_accum=2).validate(), None)
    assert plain.batch.global_batch == 96 and plain.batch.cut(3).grad_accum == 2
    assert plain.config.global_batch is None and plain.batch.global_batch == 96
    with pytest.raises(ConfigError, match="--global-batch 3 gives some of the 4 workers no rows"):
        resolve(TrainConfig(workers=4, global_batch=3).validate(), None)


def test_a_checkpoint_keeps_the_intent_and_the_plan_apart_and_reads_both():
    from ray_ddp.checkpoint.format import TrainState, checkpoint_header
    from ray_ddp.plan import saved_run_config

    plan = resolve(TrainConfig(workers="1-2", batch_size=16, grad_accum=2).validate(), None)
    # what a worker at world size 1 saves: the user's accumulation, not its cut's (4)
    assert plan.batch.cut(1).grad_accum == 4
    header = checkpoint_header(TrainState(1, 10, 0, []), {"config": plan.config.to_dict(), "plan": plan.planned()}, 0)
    assert (header["config"]["grad_accum"], header["config"]["global_batch"], header["config"]["task"]) == (2, None, None)
    assert (header["plan"]["global_batch"], header["plan"]["task"]) == (64, "regression")
    run = saved_run_config(header)
    assert (run["grad_accum"], run["global_batch"], run["task"], run["workers"]) == (2, 64, "regression", "1-2")
    older = {"config": {"task": "classification", "global_batch": 32}}  # before the plan was kept apart
    assert saved_run_config(older) == older["config"]
