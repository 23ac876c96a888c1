"""What ``ray-ddp tune --config FILE`` asks for: the file's train keys, its ``search:``
space and the tune keys, read and checked into a TuneConfig; the space as Ray Tune
sampling objects; and one trial's TrainConfig. Runs on the driver, before Tune starts:
every mistake is one ConfigError line, and nothing has been written yet."""

from __future__ import annotations

import dataclasses
import difflib
import math
from dataclasses import dataclass
from typing import Any, Optional

from ray_ddp.config.reading import read_yaml_mapping
from ray_ddp.config.train import TrainConfig
from ray_ddp.data.checks import check_data_paths
from ray_ddp.errors import ConfigError

DISTRIBUTIONS = ("loguniform", "uniform", "choice", "randint")
# metric -> (mode, the task whose validation reports it; None: every task)
METRICS = {"val_loss": ("min", None), "val_accuracy": ("max", "classification"),
           "val_perplexity": ("min", "lm")}
SCHEDULERS = ("asha", "none")
# The file's tune keys; ``seed`` stays train's, so the search's own is ``search_seed`` (default: it).
TUNE_KEYS = ("search", "scheduler", "metric", "grace_epochs", "trials", "concurrent", "search_seed")
# Train keys a trial must not vary, and why (the reason goes into the message).
_OUTPUT, _TRACKING = "it is output, not a hyperparameter", "tracking is the experiment's"
UNSEARCHABLE = {"name": "tune names every trial's run itself", "address": "trials run on tune's Ray",
                "storage": "every trial lives under the experiment's storage", "mlflow": _TRACKING,
                "mlflow_experiment": _TRACKING, "mlflow_parent_run": _TRACKING, "wandb": _TRACKING,
                "wandb_entity": _TRACKING, "wandb_group": _TRACKING, "json": _OUTPUT, "quiet": _OUTPUT,
                "verbose": _OUTPUT, "profile": _OUTPUT}
FIELDS = {f.name: f for f in dataclasses.fields(TrainConfig)}


@dataclass(frozen=True)
class TuneConfig:
    """The base train keys (field names, searched ones left out), the space, the trials."""

    train: dict
    search: dict
    trials: int = 4
    concurrent: int = 2
    scheduler: str = "asha"
    metric: str = "val_loss"
    mode: str = "min"
    grace_epochs: int = 1
    seed: int = 0


def load_tune_config(path: str, overrides: dict) -> TuneConfig:
    """FILE with the CLI's values (trials, concurrent, storage, name; None: not given), checked."""
    raw, given = read_yaml_mapping(path), {k: v for k, v in overrides.items() if v is not None}
    names = {key: str(key).replace("-", "_") for key in raw}
    tune = {names[k]: v for k, v in raw.items() if names[k] in TUNE_KEYS}
    tune.update({k: given[k] for k in ("trials", "concurrent") if k in given})
    train = {k: v for k, v in raw.items() if names[k] not in TUNE_KEYS}
    train.update({k: given[k] for k in ("storage", "name") if k in given})
    TrainConfig.from_dict(train)  # unknown keys and bad values, in from_dict's words
    counts = {k: _require_int(tune.get(k, default), k, path, least=1)
              for k, default in (("trials", 4), ("concurrent", 2), ("grace_epochs", 1))}
    metric, scheduler = tune.get("metric", "val_loss"), tune.get("scheduler", "asha")
    for key, value, known in (("metric", metric, tuple(METRICS)), ("scheduler", scheduler, SCHEDULERS)):
        if value not in known:
            raise ConfigError(f"{key} {value!r} in {path} is not one tune knows; use {' or '.join(known)}")
    search = read_search(tune.get("search"), path)
    # A key both fixed and searched is searched: the file can stay a `ray-ddp train` config.
    train = {k.replace("-", "_"): v for k, v in train.items() if k.replace("-", "_") not in search}
    base = check_points(train, search, metric, path)
    want, task = METRICS[metric][1], base.task or ("lm" if base.model == "gpt" else None)
    if want and task and task != want:
        raise ConfigError(f"metric {metric} is reported by --task {want} runs and this one is "
                          f"--task {task}; use metric: val_loss in {path}")
    # ASHA stops trials from grace_epochs on: it must fit in the fewest epochs a trial runs
    epochs = min(TrainConfig.from_dict({"epochs": v}).epochs
                 for v in pick_candidates(*search.get("epochs", ("choice", (base.epochs,)))))
    if counts["grace_epochs"] > epochs:
        raise ConfigError(f"grace_epochs {counts['grace_epochs']} is more than the {epochs} epochs "
                          f"a trial may run; give grace_epochs from 1 to {epochs} in {path}")
    seed = _require_int(tune.get("search_seed", TrainConfig.from_dict(train).seed), "search_seed", path)
    return TuneConfig(train=train, search=search, scheduler=scheduler, metric=metric,
                      mode=METRICS[metric][0], seed=seed, **counts)


def sample_space(tc: TuneConfig) -> dict:
    """The space as ray.tune sampling objects (kinds named as its functions; importing it starts no Ray)."""
    from ray import tune

    return {key: getattr(tune, kind)(*([list(args)] if kind == "choice" else args))
            for key, (kind, args) in tc.search.items()}


def trial_config(tc: TuneConfig, params: dict, storage: str, name: str) -> TrainConfig:
    """One trial's run: the base keys with its sampled params, quiet (Tune reports)."""
    values = {**tc.train, **params, "storage": storage, "name": name, "quiet": True}
    return TrainConfig.from_dict(values).validate()


def read_search(spec: Any, path: str) -> dict:
    """``search:`` as key -> (distribution, args), every key and distribution checked."""
    if not spec or not isinstance(spec, dict):
        raise ConfigError(f"search: in {path} must map train keys to distributions (e.g. lr: "
                          "{loguniform: [0.0001, 0.1]}); with none there is nothing to tune")
    search = {}
    for key, dist in spec.items():
        name = str(key).replace("-", "_")
        if name not in FIELDS:
            close = difflib.get_close_matches(name, FIELDS, n=1)
            hint = f"did you mean {close[0]}?" if close else "see `ray-ddp train --help`"
            raise ConfigError(f"search key '{key}' is not a train option; {hint}")
        if name in UNSEARCHABLE:
            raise ConfigError(f"search key '{key}' cannot be searched: {UNSEARCHABLE[name]}; "
                              "set it as a plain key (or a tune flag) instead")
        search[name] = read_distribution(str(key), name, dist)
    return search


def read_distribution(key: str, name: str, dist: Any) -> tuple[str, tuple]:
    """One ``{kind: args}`` as (kind, args), its args checked for the kind and the field."""
    if not isinstance(dist, dict) or len(dist) != 1:
        raise ConfigError(f"search.{key} must be a mapping with exactly one distribution "
                          f"({', '.join(DISTRIBUTIONS)}), got {dist!r}")
    (kind, args), = dist.items()
    if kind not in DISTRIBUTIONS:
        close = difflib.get_close_matches(str(kind), DISTRIBUTIONS, n=1)
        hint = f" (did you mean {close[0]}?)" if close else ""
        raise ConfigError(f"search.{key}: unknown distribution {kind!r}{hint}; use {', '.join(DISTRIBUTIONS)}")
    if kind == "choice":
        if not isinstance(args, list) or not args:
            raise ConfigError(f"search.{key}: choice takes a non-empty list of values, got {args!r}")
        return kind, tuple(args)
    bounds = args if isinstance(args, list) and len(args) == 2 else [None, None]
    lo, hi = (_to_number(b) for b in bounds)
    whole = kind != "randint" or all(isinstance(b, int) and not isinstance(b, bool) for b in bounds)
    if lo is None or hi is None or not whole or not lo < hi or (kind == "loguniform" and lo <= 0):
        need = {"randint": "two whole numbers with lo < hi (hi excluded)",
                "loguniform": "two numbers with 0 < lo < hi"}.get(kind, "two numbers with lo < hi")
        raise ConfigError(f"search.{key}: {kind} takes [lo, hi], {need}, got {args!r}")
    if kind != "randint" and "float" not in str(FIELDS[name].type):  # 12.7 would fail coercion
        raise ConfigError(f"search.{key}: {kind} draws real numbers, {name} takes {FIELDS[name].type}: "
                          "use randint or choice")
    return kind, tuple(bounds) if kind == "randint" else (lo, hi)


def pick_candidates(kind: str, args: tuple) -> tuple:
    """The values that stand for a distribution: both ends of a range, or every choice."""
    return (args[0], args[1] - 1) if kind == "randint" else args


def check_points(train: dict, search: dict, metric: str, path: str) -> TrainConfig:
    """Check the file with each search key at its first value (the base), then each key's
    other values against the base; a failure names the search key. The base back."""
    base = {**train, **{key: pick_candidates(*spec)[0] for key, spec in search.items()}}
    problem = find_problem(base, metric, path)
    for key, spec in search.items():
        others = [{**base, key: value} for value in pick_candidates(*spec)[1:]]
        if problem is not None:  # the base broken: blame a first value that another value mends
            others.append({k: v for k, v in base.items() if k != key})  # or the field's default
            if any(find_problem(point, metric, path) is None for point in others):
                raise ConfigError(f"search.{key}: {base[key]!r} cannot be used: {problem}")
            continue
        for point in others:
            if (err := find_problem(point, metric, path)) is not None:
                raise ConfigError(f"search.{key}: {point[key]!r} cannot be used: {err}")
    if problem is not None:
        raise problem  # no search value to blame: the file's own keys, in train's words
    return TrainConfig.from_dict(base).validate()


def find_problem(values: dict, metric: str, path: str) -> Optional[ConfigError]:
    """What train's coercion and checks refuse in one trial's keys, or missing validation data."""
    try:
        cfg = TrainConfig.from_dict(values).validate()
        check_data_paths(cfg)
    except ConfigError as err:
        return err
    if not (cfg.val_data or cfg.val_fraction > 0):
        return ConfigError(f"tune ranks trials by {metric}: give val_data or val_fraction in {path}")
    return None


def _to_number(value: Any) -> Optional[float]:
    """A finite number, or None; strings too, as PyYAML reads 1e-4 (no dot) as a string."""
    try:
        number = math.nan if isinstance(value, bool) else float(value)
    except (TypeError, ValueError):
        return None
    return number if math.isfinite(number) else None


def _require_int(value: Any, key: str, path: str, least: Optional[int] = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or (least is not None and value < least):
        floor = f", {least} or more" if least is not None else ""
        raise ConfigError(f"{key} must be a whole number{floor} (in {path} or its flag), got {value!r}")
    return value


def max_epochs(tc: TuneConfig) -> int:
    """The most epochs a trial runs: ASHA's horizon (epochs may be searched too)."""
    if "epochs" in tc.search:
        return int(max(pick_candidates(*tc.search["epochs"])))
    return int(tc.train.get("epochs") or TrainConfig.epochs)
