"""Each trial's drawn hyperparameters, kept in ``<storage>/<name>/draws.json`` from the
search's first run on. Runs on the driver of the search, before Ray starts.

A rerun of the same ``--name`` continues the search: trial k resumes its run folder from
its checkpoint. Were the file's ``search:`` (or ``search_seed``) edited in between, the
same seed would draw other values and trial k would train on from weights made under
the old ones, while trials.parquet reported only the new. So each draw is stored when
first drawn, and a rerun whose draw differs for a trial that has started is refused.
"""

from __future__ import annotations

import json
import time
from typing import Any

from ray_ddp.errors import ConfigError
from ray_ddp.storage import Storage, read_json, write_json
from ray_ddp.tune.space import TuneConfig, sample_space

DRAWS_FILE = "draws.json"
_NOT_SEARCHED = object()


def draw_trials(tc: TuneConfig) -> list[dict[str, Any]]:
    """The params of trials 0..trials-1, as Tune's BasicVariantGenerator seeded with the
    search seed draws them (its own sampling, run here without Ray): the search hands
    them to Tune, so trial k trains with exactly the k-th."""
    from ray.tune.search.sample import _BackwardsCompatibleNumpyRng
    from ray.tune.search.variant_generator import generate_variants

    # one generator for all trials, as BasicVariantGenerator's: trial k's draw follows k-1's
    rng = _BackwardsCompatibleNumpyRng(tc.seed)
    space = {"config": sample_space(tc)}
    draws = []
    for _ in range(tc.trials):
        _, spec = next(iter(generate_variants(space, random_state=rng)))
        draws.append(_as_json(spec["config"]))
    return draws


def read_draws(store: Storage, root: str) -> dict[int, dict[str, Any]]:
    """The stored draws by trial index ({} for a search that stored none)."""
    stored = read_json(store.fs, f"{root}/{DRAWS_FILE}") or {}
    return {int(k): v["params"] for k, v in stored.get("trials", {}).items()}


def check_draws(tc: TuneConfig, store: Storage, root: str) -> list[dict[str, Any]]:
    """This file's draws; a ConfigError (one line, nothing written) when a trial that has
    a run folder was drawn otherwise before. A trial without one never started: its new
    draw replaces the old when saved."""
    draws = draw_trials(tc)
    stored = read_json(store.fs, f"{root}/{DRAWS_FILE}") or {}
    started = _started_trials(store, root)
    for index, draw in enumerate(draws):
        old = stored.get("trials", {}).get(str(index))
        if old is None or index not in started or old["params"] == draw:
            continue
        key, was, now = _first_difference(old["params"], draw)
        raise ConfigError(f"trial-{index}'s {key} was {was}, now {now}: the search: section (or "
                          f"search_seed) changed since trial-{index} was drawn ({old.get('drawn', '?')}) "
                          f"and it would resume under other values; use a new --name to search again")
    return draws


def save_draws(store: Storage, root: str, draws: list[dict[str, Any]]) -> None:
    """Store ``draws`` (checked by ``check_draws``) beside the trials: those stored already
    keep their first date, new or changed ones are dated now. One atomic write."""
    stored = (read_json(store.fs, f"{root}/{DRAWS_FILE}") or {}).get("trials", {})
    now = time.strftime("%Y-%m-%d %H:%M:%S")
    trials = dict(stored)
    for index, draw in enumerate(draws):
        old = stored.get(str(index))
        trials[str(index)] = old if old is not None and old["params"] == draw else {"params": draw, "drawn": now}
    if trials != stored:
        store.fs.create_dir(root, recursive=True)
        write_json(store.fs, f"{root}/{DRAWS_FILE}", {"trials": trials})


def _started_trials(store: Storage, root: str) -> set[int]:
    """The indices of the trials whose run folder exists."""
    from pyarrow.fs import FileSelector, FileType

    infos = store.fs.get_file_info(FileSelector(root, allow_not_found=True))
    return {int(i.base_name.split("-", 1)[1]) for i in infos
            if i.type == FileType.Directory and i.base_name.startswith("trial-")
            and i.base_name.split("-", 1)[1].isdigit()}


def _first_difference(old: dict[str, Any], new: dict[str, Any]) -> tuple[str, str, str]:
    """(key, its old value, its new value) of the first key that differs, in the old
    draw's order, then the new keys."""
    for key in [*old, *(k for k in new if k not in old)]:
        was, now = old.get(key, _NOT_SEARCHED), new.get(key, _NOT_SEARCHED)
        if was != now:
            return key, _show(was), _show(now)
    raise AssertionError("the draws differ but no key does")  # a bug: the caller compared them


def _show(value: Any) -> str:
    return "not searched" if value is _NOT_SEARCHED else str(value)


def _as_json(params: dict[str, Any]) -> dict[str, Any]:
    """``params`` as draws.json gives them back (a tuple a list, numpy scalars plain), so
    that a stored draw and a new one compare equal when they are the same."""
    return json.loads(json.dumps(params, default=lambda v: v.item() if hasattr(v, "item") else str(v)))
