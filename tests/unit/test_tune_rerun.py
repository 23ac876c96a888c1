"""A rerun of `ray-ddp tune --name N` after the file's search: changed: each trial's draw
is stored when first drawn, and a rerun whose draw for a started trial differs is
refused in one line before anything starts or is written (no Ray: the draws are Tune's
own generator run offline, and the search is stopped before it would attach to Ray)."""

from __future__ import annotations

import os
import sys

import pytest

from ray_ddp.errors import ConfigError
from ray_ddp.storage import resolve_storage
from ray_ddp.tune.space import load_tune_config

FILE = "model: mlp\nepochs: 2\nval-fraction: 0.2\nsearch_seed: 3\ntrials: 3\n"
SEARCH = "search:\n  lr: {loguniform: [1.0e-4, 1.0e-1]}\n  width: {choice: [16, 32, 64]}\n"
NO_FLAGS = {"trials": None, "concurrent": None, "storage": None, "name": None}


def load(tmp_path, search=SEARCH, **flags):
    path = tmp_path / "search.yaml"
    path.write_text(FILE + search)
    return load_tune_config(str(path), {**NO_FLAGS, "storage": str(tmp_path / "runs"), "name": "s", **flags})


def files_under(root) -> dict[str, bytes]:
    out = {}
    for folder, _, names in os.walk(root):
        for name in names:
            with open(os.path.join(folder, name), "rb") as f:
                out[os.path.relpath(os.path.join(folder, name), root)] = f.read()
    return out


def first_run(tmp_path, tc, started=(0, 1)):
    """What a first search leaves: the draws stored, and the trials that started have
    their run folders (a checkpoint's worth of file in each)."""
    from ray_ddp.tune.draws import check_draws, save_draws

    store, root = resolve_storage(str(tmp_path / "runs")), str(tmp_path / "runs" / "s")
    draws = check_draws(tc, store, root)
    save_draws(store, root, draws)
    for k in started:
        os.makedirs(f"{root}/trial-{k}/step-00000010")
        open(f"{root}/trial-{k}/step-00000010/model.pt", "wb").close()
    return store, root, draws


def test_the_draws_are_those_tune_draws_and_hands_each_trial(tmp_path):
    """Offline, Tune's generator with the search seed draws what a search's Tune draws;
    handed the draws, Tune gives trial k exactly draw k (the stored one)."""
    from ray.tune.experiment import Experiment
    from ray.tune.search.basic_variant import BasicVariantGenerator

    from ray_ddp.tune.draws import draw_trials
    from ray_ddp.tune.space import sample_space

    tc = load(tmp_path, SEARCH + "  batch_size: {randint: [8, 33]}\n  clip_grad: {uniform: [0, 2]}\n",
              trials=5)
    draws = draw_trials(tc)
    assert len(draws) == 5 and len({d["lr"] for d in draws}) == 5

    def configs(search_alg):
        search_alg.add_configurations([Experiment("x", lambda config: None, config=sample_space(tc),
                                                   num_samples=tc.trials)])
        trials = iter(search_alg.next_trial, None)
        return {int(t.trial_id.rsplit("_", 1)[-1]): t.config for t in trials}

    # what the search drew before the draws were stored: a search begun then continues
    assert configs(BasicVariantGenerator(random_state=tc.seed)) == dict(enumerate(draws))
    assert configs(BasicVariantGenerator(points_to_evaluate=[dict(d) for d in draws],
                                         random_state=tc.seed)) == dict(enumerate(draws))


def test_the_same_file_rerun_goes_on_and_more_trials_are_added(tmp_path):
    from ray_ddp.tune.draws import check_draws, read_draws, save_draws

    tc = load(tmp_path)
    store, root, draws = first_run(tmp_path, tc)
    assert check_draws(tc, store, root) == draws
    assert read_draws(store, root) == dict(enumerate(draws))
    more = load(tmp_path, trials=5)  # the same seed draws the first three again, then two more
    more_draws = check_draws(more, store, root)
    assert more_draws[:3] == draws
    save_draws(store, root, more_draws)
    assert read_draws(store, root) == dict(enumerate(more_draws))


@pytest.mark.parametrize("search, words", [
    # the range edited: every trial draws another lr
    ("search:\n  lr: {loguniform: [1.0e-3, 1.0]}\n  width: {choice: [16, 32, 64]}\n",
     ["trial-0's lr was ", ", now "]),
    # a key no longer searched, or a new one
    ("search:\n  lr: {loguniform: [1.0e-4, 1.0e-1]}\n", ["trial-0's width was ", ", now not searched"]),
    ("search:\n  lr: {loguniform: [1.0e-4, 1.0e-1]}\n  width: {choice: [16, 32, 64]}\n"
     "  optimizer: {choice: [sgd, adamw]}\n", ["trial-0's optimizer was not searched, now "]),
])
def test_an_edited_search_is_refused_in_one_line_and_nothing_is_written(tmp_path, search, words):
    from ray_ddp.tune.draws import check_draws

    store, root, _ = first_run(tmp_path, load(tmp_path))
    before = files_under(tmp_path / "runs")
    with pytest.raises(ConfigError) as info:
        check_draws(load(tmp_path, search), store, root)
    message = str(info.value)
    assert "\n" not in message
    for word in words + ["the search: section", "use a new --name to search again"]:
        assert word in message, message
    assert files_under(tmp_path / "runs") == before


def test_another_search_seed_is_refused_too(tmp_path):
    from ray_ddp.tune.draws import check_draws

    store, root, _ = first_run(tmp_path, load(tmp_path))
    with pytest.raises(ConfigError, match="trial-0's lr was .*search_seed"):
        check_draws(load(tmp_path, SEARCH.replace("search:", "search_seed: 4\nsearch:")), store, root)


def test_a_trial_that_never_started_takes_the_new_draw(tmp_path):
    """Only a trial whose run folder exists would resume under other params: one drawn
    but never started (the search stopped before it) is drawn again."""
    from ray_ddp.tune.draws import check_draws, read_draws, save_draws

    store, root, _ = first_run(tmp_path, load(tmp_path), started=())
    edited = load(tmp_path, "search:\n  lr: {loguniform: [1.0e-3, 1.0]}\n")
    draws = check_draws(edited, store, root)
    save_draws(store, root, draws)
    assert read_draws(store, root) == dict(enumerate(draws))


def test_the_cli_refuses_before_anything_starts_exit_2(tmp_path, capsys, monkeypatch):
    """Through `ray-ddp tune`: a first run stores its draws once it can start; the rerun of the
    edited file says one line, exits 2, and writes nothing. Ray is never started here:
    reaching it is this test's failure."""
    import ray_ddp.tune.search as search
    from ray_ddp.cli.main import main

    class WouldStartRay(Exception):
        pass

    def attach_ray(*args, **kwargs):
        raise WouldStartRay()

    monkeypatch.setattr(search, "attach_ray", attach_ray)
    path = tmp_path / "search.yaml"
    argv = ["tune", "--config", str(path), "--storage", str(tmp_path / "runs"), "--name", "s"]
    path.write_text(FILE + SEARCH)
    with pytest.raises(WouldStartRay):
        main(argv)
    root = tmp_path / "runs" / "s"
    assert not (root / "draws.json").exists()  # stored once the search can start, not before Ray
    first_run(tmp_path, load(tmp_path))  # what the first run left once it started: its draws, 2 trials
    before = files_under(tmp_path / "runs")
    path.write_text(FILE + SEARCH.replace("1.0e-4, 1.0e-1", "1.0e-3, 1.0"))
    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "ray-ddp tune: error: trial-0's lr was " in err, err
    assert "use a new --name to search again" in err
    assert files_under(tmp_path / "runs") == before


def test_a_finished_search_with_an_edited_file_is_refused_too(tmp_path, monkeypatch):
    """A finished search prints its table without Ray: rerun with another search: it
    would print the old trials as this file's, so it is refused as well."""
    import pyarrow as pa

    import ray_ddp.tune.search as search
    from ray_ddp.storage import write_table

    monkeypatch.setattr(search, "attach_ray", lambda *a, **k: pytest.fail("Ray would start"))
    tc = load(tmp_path)
    store, root, draws = first_run(tmp_path, tc, started=(0, 1, 2))
    rows = [{"trial": k, **d, "val_loss": 0.5, "unfinished": False} for k, d in enumerate(draws)]
    write_table(store.fs, f"{root}/trials.parquet", pa.Table.from_pylist(rows))
    assert search.run_search(tc, echo=lambda line: None) == rows
    with pytest.raises(ConfigError, match="trial-0's lr was "):
        search.run_search(load(tmp_path, SEARCH.replace("1.0e-4", "1.0e-3")), echo=lambda line: None)
