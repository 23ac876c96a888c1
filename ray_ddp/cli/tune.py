"""``ray-ddp tune``: a Ray Tune search over ray-ddp runs, from a YAML file of train keys
plus ``search:`` (ray_ddp/tune/). Prints a line per trial and the final table. Runs on
the driver."""

from __future__ import annotations

import argparse
import sys

from ray_ddp.cli.common import EXIT_INTERRUPTED, EXIT_TRAINING_FAILED, fmt
from ray_ddp.errors import TrainingError
from ray_ddp.tune.space import load_tune_config


def add_parser(sub) -> None:
    tune = sub.add_parser("tune", help="search hyperparameters: Ray Tune over ray-ddp runs (ASHA by default)")
    tune.add_argument("--config", required=True, metavar="FILE.yaml",
                      help="train keys, plus search: (key: {loguniform|uniform|choice|randint: ...}), "
                           "and optionally scheduler, metric, grace_epochs, trials, concurrent, seed")
    tune.add_argument("--trials", type=int, help="trials to run (default: the file's, else 4)")
    tune.add_argument("--concurrent", type=int, help="trials at once (default: the file's, else 2)")
    tune.add_argument("--storage", help="where the search's folder goes (default: the file's storage)")
    tune.add_argument("--name", help="the search's name: its folder, and what a rerun continues "
                                     "(default: the file's name, else tune-<time>)")


def run(args: argparse.Namespace) -> int:
    # here, not at the top: `ray-ddp --help` imports every command's module and needs none of what this one runs
    from ray_ddp.tune.search import run_search, search_name

    tc = load_tune_config(args.config, {"trials": args.trials, "concurrent": args.concurrent,
                                        "storage": args.storage, "name": args.name})
    if not tc.train.get("name"):  # every line and the folder name the same search
        tc = type(tc)(**{**tc.__dict__, "train": {**tc.train, "name": search_name(tc)}})
    try:
        rows = run_search(tc, echo=print)
    except TrainingError as err:
        print(f"ray-ddp tune: {err}", file=sys.stderr)
        return EXIT_TRAINING_FAILED
    print(format_trials(rows, list(tc.search)))
    unfinished = [r for r in rows if r["unfinished"]]
    if unfinished:
        print(f"ray-ddp tune: interrupted with {len(unfinished)} trial(s) unfinished; run the same "
              "command again to continue the search", file=sys.stderr)
        return EXIT_INTERRUPTED
    done = [r for r in rows if r[tc.metric] is not None]  # best first
    if not done:
        print("ray-ddp tune: no trial reported a validation", file=sys.stderr)
        return EXIT_TRAINING_FAILED
    print(f"best: trial {done[0]['trial']} ({tc.metric} {done[0][tc.metric]:.4f}); checkpoint "
          f"{done[0]['checkpoint']}; trials.parquet and best.json in {rows[0]['run'].rsplit('/', 1)[0]}")
    return 0


def format_trials(rows: list[dict], keys: list[str]) -> str:
    head = ["trial", *keys, "val_loss", "epochs", "ended", "run"]
    lines = [head] + [[str(r["trial"]), *(fmt(r[k], ".4g") if isinstance(r[k], float) else str(r[k]) for k in keys),
                       fmt(r["val_loss"]), str(r["epochs"]), _ended(r), r["run"]] for r in rows]
    widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(line, widths)).rstrip() for line in lines)


def _ended(row: dict) -> str:
    return ("unfinished" if row["unfinished"] else "failed" if row["error"] else
            "stopped early" if row["stopped_early"] else "finished")
