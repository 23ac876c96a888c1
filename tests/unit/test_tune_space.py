"""ray_ddp.tune.space: the tune YAML read into a TuneConfig, every mistake one
ConfigError line naming the key, the ray.tune space and a trial's TrainConfig (no Ray)."""

import dataclasses

import pytest

from ray_ddp.config.train import TrainConfig
from ray_ddp.errors import ConfigError
from ray_ddp.tune.space import TuneConfig, load_tune_config, sample_space, trial_config

BASE = "model: mlp\nepochs: 3\nval-fraction: 0.2\n"
LR = "search:\n  lr: {loguniform: [1e-4, 1.0e-1]}\n"
NO_FLAGS = {"trials": None, "concurrent": None, "storage": None, "name": None}


def load(tmp_path, text, **overrides):
    path = tmp_path / "tune.yaml"
    path.write_text(text)
    return load_tune_config(str(path), {**NO_FLAGS, **overrides})


def refused(tmp_path, text, *names, **overrides):
    """The ConfigError of ``text``: one line naming each of ``names``."""
    with pytest.raises(ConfigError) as info:
        load(tmp_path, text, **overrides)
    message = str(info.value)
    assert "\n" not in message
    for name in names:
        assert name in message, message
    return message


def test_file_is_parsed_into_train_keys_search_and_defaults(tmp_path):
    tc = load(tmp_path, BASE + "lr: 0.5\nbatch-size: 16\nseed: 7\n" + LR +
              "  batch-size: {choice: [16, 32]}\n  width: {randint: [32, 65]}\n"
              "  clip_grad: {uniform: [0, 2]}\n")
    # the searched keys leave the train keys (lr, batch-size), the rest keep field names
    assert tc.train == {"model": "mlp", "epochs": 3, "val_fraction": 0.2, "seed": 7}
    # 1e-4 is a string to PyYAML (no dot): read as the number it means
    assert tc.search == {"lr": ("loguniform", (1e-4, 0.1)), "batch_size": ("choice", (16, 32)),
                         "width": ("randint", (32, 65)), "clip_grad": ("uniform", (0.0, 2.0))}
    assert (tc.trials, tc.concurrent, tc.scheduler, tc.metric, tc.mode, tc.grace_epochs) == (
        4, 2, "asha", "val_loss", "min", 1)
    assert tc.seed == 7  # the search seed defaults to the train seed


def test_tune_keys_and_flags(tmp_path):
    text = (BASE + LR + "trials: 8\nconcurrent: 3\nscheduler: none\ngrace-epochs: 2\n"
            "search_seed: 11\nname: from-file\n")
    tc = load(tmp_path, text)
    assert (tc.trials, tc.concurrent, tc.scheduler, tc.grace_epochs, tc.seed) == (8, 3, "none", 2, 11)
    assert tc.train["name"] == "from-file" and "storage" not in tc.train
    tc = load(tmp_path, text, trials=2, concurrent=1, storage="/tmp/runs", name="exp")
    assert (tc.trials, tc.concurrent) == (2, 1)
    assert (tc.train["storage"], tc.train["name"]) == ("/tmp/runs", "exp")


def test_metric_sets_the_mode(tmp_path):
    tc = load(tmp_path, BASE + "task: classification\nmetric: val_accuracy\n" + LR)
    assert (tc.metric, tc.mode) == ("val_accuracy", "max")
    tc = load(tmp_path, "model: gpt\nval-fraction: 0.1\nmetric: val_perplexity\n" + LR)
    assert (tc.metric, tc.mode) == ("val_perplexity", "min")


@pytest.mark.parametrize("key", ["name", "storage", "address", "json", "quiet", "verbose",
                                 "mlflow", "mlflow-experiment", "profile"])
def test_keys_that_cannot_be_searched(tmp_path, key):
    refused(tmp_path, BASE + f"search:\n  {key}: {{choice: [a, b]}}\n", f"'{key}'", "cannot be searched")


@pytest.mark.parametrize("search, names", [
    ("batch_sise: {choice: [8]}", ["'batch_sise'", "batch_size"]),
    ("learning_rate: {uniform: [0.1, 0.2]}", ["'learning_rate'", "not a train option"]),
    ("lr: {logunifrom: [0.001, 0.1]}", ["search.lr", "logunifrom", "loguniform", "uniform", "choice", "randint"]),
    ("lr: {uniform: [0.1, 0.2], choice: [0.1]}", ["search.lr", "exactly one"]),
    ("lr: 0.1", ["search.lr", "exactly one"]),
    ("lr: {}", ["search.lr", "exactly one"]),
    ("lr: {loguniform: [0, 0.1]}", ["search.lr", "0 < lo < hi"]),
    ("lr: {loguniform: [0.1, 0.01]}", ["search.lr", "loguniform"]),
    ("lr: {uniform: [0.2, 0.2]}", ["search.lr", "lo < hi"]),
    ("lr: {uniform: [a, b]}", ["search.lr", "two numbers"]),
    ("lr: {uniform: [0.1]}", ["search.lr", "[lo, hi]"]),
    ("lr: {uniform: 0.1}", ["search.lr", "[lo, hi]"]),
    ("lr: {uniform: [0.1, .inf]}", ["search.lr", "two numbers"]),
    ("width: {randint: [1.5, 8]}", ["search.width", "whole numbers"]),
    ("width: {randint: [8, 8]}", ["search.width", "hi excluded"]),
    ("width: {randint: [true, 8]}", ["search.width", "whole numbers"]),
    ("width: {choice: []}", ["search.width", "non-empty list"]),
    ("width: {choice: 64}", ["search.width", "non-empty list"]),
    ("batch-size: {uniform: [8, 64]}", ["search.batch-size", "randint or choice"]),
    # values the field cannot take, through train's own coercion and checks
    ("batch_size: {choice: [0, 8]}", ["search.batch_size", "0", "--batch-size"]),
    ("batch_size: {choice: [8, 0]}", ["search.batch_size", "--batch-size"]),
    ("batch_size: {choice: [0]}", ["search.batch_size", "--batch-size"]),
    ("batch_size: {randint: [0, 8]}", ["search.batch_size", "--batch-size"]),
    ("batch_size: {choice: [8, many]}", ["search.batch_size", "'many'"]),
    ("optimizer: {choice: [sgd, adam]}", ["search.optimizer", "'adam'"]),
    ("val_fraction: {uniform: [0.1, 1.0]}", ["search.val_fraction", "--val-fraction"]),
    ("val_fraction: {choice: [0.0, 0.2]}", ["search.val_fraction", "val_data or val_fraction"]),
])
def test_bad_search_entries(tmp_path, search, names):
    refused(tmp_path, BASE + "search:\n  " + search + "\n", *names)


def test_value_checked_against_the_other_keys(tmp_path):
    # width 96 splits over 4 or 6 heads, not 5: blamed on the searched heads
    refused(tmp_path, "model: gpt\nwidth: 96\nval-fraction: 0.1\nsearch:\n  heads: {choice: [4, 6, 5]}\n",
            "search.heads", "5", "--heads")


def test_the_files_own_mistake_is_not_blamed_on_search(tmp_path):
    message = refused(tmp_path, "model: mlp\nepochs: 0\nval-fraction: 0.2\n" + LR, "--epochs")
    assert "search." not in message


@pytest.mark.parametrize("text, names", [
    (BASE, ["search:", "nothing to tune"]),
    (BASE + "search:\n", ["search:", "nothing to tune"]),
    (BASE + "search: {}\n", ["search:", "nothing to tune"]),
    (BASE + "search: [lr]\n", ["search:", "distributions"]),
    ("model: mlp\n" + LR, ["val_loss", "val_data or val_fraction", "tune.yaml"]),
    (BASE + LR + "scheduler: hyperband\n", ["scheduler", "'hyperband'", "asha"]),
    (BASE + LR + "metric: val_acc\n", ["metric", "'val_acc'", "val_accuracy"]),
    (BASE + LR + "metric: [val_loss]\n", ["metric", "val_loss"]),
    (BASE + "task: regression\nmetric: val_accuracy\n" + LR, ["val_accuracy", "classification", "regression"]),
    (BASE + LR + "grace_epochs: 0\n", ["grace_epochs", "1 or more"]),
    (BASE + LR + "grace_epochs: 4\n", ["grace_epochs", "3 epochs"]),
    (BASE + LR + "  epochs: {choice: [5, 2]}\ngrace_epochs: 3\n", ["grace_epochs", "2 epochs"]),
    (BASE + LR + "trials: 0\n", ["trials", "1 or more"]),
    (BASE + LR + "trials: many\n", ["trials", "'many'"]),
    (BASE + LR + "concurrent: 0\n", ["concurrent", "1 or more"]),
    (BASE + LR + "search_seed: x\n", ["search_seed", "whole number"]),
    (BASE + "lrr: 0.1\n" + LR, ["unknown config key 'lrr'"]),
    (BASE + "epochs: many\n" + LR, ["'epochs'", "'many'"]),
    ("- model\n- mlp\n", ["must hold a mapping"]),
    ("model: [unclosed\n", ["not valid YAML"]),
])
def test_bad_files(tmp_path, text, names):
    refused(tmp_path, text, *names)


def test_bad_flags(tmp_path):
    refused(tmp_path, BASE + LR, "trials", "1 or more", trials=0)
    refused(tmp_path, BASE + LR, "concurrent", "1 or more", concurrent=-1)
    refused(tmp_path, BASE + LR, "--name", name="a/b")


def test_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="config file not found"):
        load_tune_config(str(tmp_path / "absent.yaml"), NO_FLAGS)


def test_sample_space_samples_within_the_space(tmp_path):
    import ray

    tc = load(tmp_path, BASE + LR + "  batch_size: {choice: [16, 32]}\n  width: {randint: [32, 34]}\n"
              "  clip_grad: {uniform: [0.5, 2]}\n")
    before = ray.is_initialized()  # the whole suite's shared Ray may be up already
    space = sample_space(tc)
    assert set(space) == {"lr", "batch_size", "width", "clip_grad"}
    draws = [{key: domain.sample() for key, domain in space.items()} for _ in range(200)]
    assert all(1e-4 <= d["lr"] <= 0.1 and 0.5 <= d["clip_grad"] <= 2 for d in draws)
    assert {d["batch_size"] for d in draws} == {16, 32}
    assert {d["width"] for d in draws} == {32, 33}  # randint's hi is excluded
    assert ray.is_initialized() == before  # building the space starts no Ray


def test_trial_config_applies_the_params(tmp_path):
    tc = load(tmp_path, BASE + "quiet: false\n" + LR + "  batch_size: {choice: [16, 32]}\n"
              "  width: {randint: [32, 65]}\n", name="exp")
    space = sample_space(tc)
    params = {key: domain.sample() for key, domain in space.items()}
    cfg = trial_config(tc, params, storage=str(tmp_path / "runs"), name="exp_trial_0")
    assert isinstance(cfg, TrainConfig)
    assert (cfg.lr, cfg.batch_size, cfg.width) == (params["lr"], params["batch_size"], params["width"])
    assert (cfg.model, cfg.epochs, cfg.val_fraction) == ("mlp", 3, 0.2)
    assert (cfg.name, cfg.storage, cfg.quiet) == ("exp_trial_0", str(tmp_path / "runs"), True)
    with pytest.raises(ConfigError, match="--batch-size"):
        trial_config(tc, {**params, "batch_size": 0}, storage="/tmp/runs", name="exp_trial_1")


def test_tune_config_is_frozen():
    tc = TuneConfig(train={}, search={})
    with pytest.raises(dataclasses.FrozenInstanceError):
        tc.trials = 9


def asha_decisions(tc, results):
    """Feed (trial, epoch, val_loss) results, in order, to the scheduler ray-ddp tune
    builds; the decision for each (real Tune objects, no Ray)."""
    from ray.tune.experiment import Trial
    from ray.tune.schedulers import TrialScheduler

    from ray_ddp.tune.search import build_scheduler

    scheduler = build_scheduler(tc)
    scheduler.set_search_properties(tc.metric, tc.mode)
    trials = {}
    decisions = []
    for name, epoch, loss in results:
        if name not in trials:
            trials[name] = Trial("ray_ddp_trial", trial_id=name, stub=True)
            scheduler.on_trial_add(None, trials[name])
        action = scheduler.on_trial_result(None, trials[name], {"epoch": epoch, "val_loss": loss})
        decisions.append("stop" if action == TrialScheduler.STOP else "go on")
    return decisions


def test_asha_stops_a_trial_worse_than_the_median_of_its_rung_and_never_the_first(tmp_path):
    tc = load(tmp_path, "model: mlp\nepochs: 4\nval-fraction: 0.2\ngrace_epochs: 1\n" + LR)
    # rungs at epochs 1 and 2 (grace 1, halving up to 4 epochs)
    assert asha_decisions(tc, [
        ("bad", 1, 9.0),   # first at rung 1: nothing to compare with, goes on
        ("good", 1, 1.0),  # better than the median of {9}: goes on
        ("worse", 1, 8.0),  # worse than the median of {9, 1}: stopped
        ("good", 2, 0.5),  # first at rung 2
        ("bad", 2, 9.5),   # worse than {0.5}: stopped at rung 2
        ("good", 3, 0.4),  # between rungs: no decision
    ]) == ["go on", "go on", "stop", "go on", "stop", "go on"]
    # the order decides nothing else: the worse trial second is stopped at once
    assert asha_decisions(tc, [("good", 1, 1.0), ("bad", 1, 9.0)]) == ["go on", "stop"]
    # a trial that reaches the last epoch ends there, as every trial does
    assert asha_decisions(tc, [("good", 4, 0.1)]) == ["stop"]


def test_no_scheduler_runs_every_trial_to_the_end(tmp_path):
    from ray_ddp.tune.search import build_scheduler

    tc = load(tmp_path, "model: mlp\nepochs: 4\nval-fraction: 0.2\nscheduler: none\n" + LR)
    assert build_scheduler(tc) is None


def test_the_trials_each_row_comes_from_are_those_tune_hands_its_callback_at_the_end(tmp_path):
    """Tune's trials reach collect_trials through the public Callback hook
    ``on_experiment_end`` (no private attribute of the ResultGrid), and each status
    makes its row: finished, stopped early by ASHA, failed, or unfinished."""
    from types import SimpleNamespace

    from ray.tune.callback import CallbackList

    from ray_ddp.storage import resolve_storage
    from ray_ddp.tune.search import collect_trials, trial_lines, tune_trials

    tc = load(tmp_path, "model: mlp\nepochs: 4\nval-fraction: 0.2\n" + LR)
    (tmp_path / "error.txt").write_text("Traceback ...\nValueError: bad lr\n")

    def trial(k, status, epoch=None, loss=None):
        last = {"epoch": epoch, "val_loss": loss} if epoch else {}
        return SimpleNamespace(trial_id=f"abc_{k:05d}", status=status, last_result=last,
                               config={"lr": 0.1 * (k + 1)}, error_file=str(tmp_path / "error.txt"))

    trials = [trial(0, "TERMINATED", 4, 0.5), trial(1, "TERMINATED", 1, 2.0), trial(2, "ERROR", 2, 1.0),
              trial(3, "PENDING")]
    lines = trial_lines(lambda line: None, tc)
    CallbackList([lines]).on_experiment_end(trials=trials)  # as Tune's controller calls it
    assert tune_trials(lines) is trials
    store = resolve_storage(str(tmp_path / "runs"))
    rows = collect_trials(tc, "s", trials, store, store.run_path("s"))
    got = {r["trial"]: (r["epochs"], r["stopped_early"], r["unfinished"], r["error"]) for r in rows}
    assert got == {0: (4, False, False, None), 1: (1, True, False, None),
                   2: (2, False, False, "ValueError: bad lr"), 3: (0, False, True, None)}
    assert [r["trial"] for r in rows] == [0, 2, 1, 3]  # best val_loss first, none last


def test_a_ray_client_address_is_refused_before_any_search_starts(tmp_path, monkeypatch):
    """Through Ray Client, Tune would run the search on the cluster and its record of the
    trials could only be read back by unpickling what storage holds: refused in one line."""
    from ray_ddp.tune.search import run_search

    tc = load(tmp_path, BASE + LR + f"storage: {tmp_path / 'runs'}\naddress: ray://head:10001\n")
    with pytest.raises(ConfigError, match=r"Ray Client \(ray://head:10001\).*ray job submit"):
        run_search(tc, echo=lambda line: None)
    assert not (tmp_path / "runs").exists()
    # the same through RAY_ADDRESS, as `ray job submit` and Ray's docs set it
    tc = load(tmp_path, BASE + LR + f"storage: {tmp_path / 'runs'}\n")
    monkeypatch.setenv("RAY_ADDRESS", "ray://head:10001")
    with pytest.raises(ConfigError, match=r"Ray Client \(ray://head:10001\)"):
        run_search(tc, echo=lambda line: None)
    assert not (tmp_path / "runs").exists()
