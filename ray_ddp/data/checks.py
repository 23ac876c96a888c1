"""The checks of the data options that must look at the data: whether --data is text or
a parquet file (for --ray-data), and whether train_data= is the --data folder's own rows.
Runs on the driver, after the options' own checks (config/checks.py, which never imports
data/), before anything is written."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from ray_ddp.config.checks import not_parquet
from ray_ddp.errors import ConfigError

if TYPE_CHECKING:
    from ray_ddp.config.train import TrainConfig


def check_data_paths(cfg: TrainConfig) -> None:
    """--ray-data reads parquet: not text, nor a file of another kind (synthetic rows:
    config/checks.py, with the options)."""
    if not cfg.ray_data:
        return
    # here, not at the top: data/text.py imports torch, which the CLI's usage errors and
    # `ray-ddp tune`'s check of its search file must not load
    from ray_ddp.data.text import is_text

    for path, flag in ((cfg.data, "--data"), (cfg.val_data, "--val-data")):
        if path is not None and path != "synthetic" and \
                (is_text(path) or (os.path.isfile(path) and not path.endswith(".parquet"))):
            raise not_parquet(flag, path)


def check_train_data(cfg: TrainConfig, train_data: Any) -> None:
    """train_data= is the training set, so --data and --dataset must not name another
    (the --data folder's own rows, opened as train_data= by data/saved.py, are not one)."""
    if train_data is None:
        return
    if cfg.dataset is not None or (cfg.data != "synthetic" and not _rows_of_data_folder(train_data, cfg.data)):
        raise ConfigError("give train_data= or --data / --dataset, not both")


def _rows_of_data_folder(train_data: Any, path: str) -> bool:
    """Whether ``train_data`` is --data's own save_to_disk folder, opened as rows
    (data/saved.py open_saved_datasets), not a second training set."""
    # not at the top: data/saved.py imports pyarrow (through storage.py), which the CLI's
    # --help and usage errors must not load
    from ray_ddp.data.saved import SavedDataset

    return isinstance(train_data, SavedDataset) and train_data.path == path
