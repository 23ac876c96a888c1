"""`ray-ddp tune`'s console: one line per trial as it starts, stops or ends (Tune's own
table is turned off), and Tune's trials once the search has ended. Runs on the driver of
the search.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

from ray_ddp.tune.space import TuneConfig, max_epochs


def trial_lines(echo: Callable[[str], None], tc: TuneConfig):
    """Tune's callback: one line per trial as it starts, stops or ends (Tune's own table
    is turned off), and Tune's trials once the search has ended (``trials``). Made here,
    so that importing this module does not import Tune."""
    from ray.tune import Callback

    class _Lines(Callback):
        trials: Optional[list] = None

        def on_trial_start(self, iteration, trials, trial, **info):
            echo(f"trial {trial_index(trial)} started: {_params(trial, tc)}")

        def on_trial_complete(self, iteration, trials, trial, **info):
            last = trial.last_result or {}
            epochs = int(trial.config.get("epochs") or max_epochs(tc))
            how = "stopped early by ASHA" if int(last.get("epoch") or 0) < epochs else "finished"
            echo(f"trial {trial_index(trial)} {how} after epoch {last.get('epoch')}: val_loss "
                 f"{_fmt(last.get('val_loss'))}")

        def on_trial_error(self, iteration, trials, trial, **info):
            echo(f"trial {trial_index(trial)} failed: {error_line(trial)}")

        def on_experiment_end(self, trials, **info):
            self.trials = trials

    return _Lines()


def trial_index(trial) -> int:
    return int(trial.trial_id.rsplit("_", 1)[-1])


def _params(trial, tc: TuneConfig) -> str:
    return ", ".join(f"{k}={_fmt(trial.config.get(k))}" for k in tc.search)


def _fmt(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def error_line(trial) -> str:
    """The last line of a failed trial's error (Tune keeps it in a file)."""
    try:
        with open(trial.error_file) as f:
            lines = [line for line in f.read().strip().splitlines() if line.strip()]
        return lines[-1][:300] if lines else "failed"
    except (OSError, TypeError):
        return "failed"
