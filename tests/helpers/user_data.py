"""A user's own map-style Dataset for --dataset user_data:regression."""

import torch
from torch.utils.data import TensorDataset


BUILT = 0  # how often this process built the data set


def regression() -> TensorDataset:
    global BUILT
    BUILT += 1
    g = torch.Generator().manual_seed(3)
    x = torch.randn(600, 10, generator=g)
    w = torch.randn(10, 5, generator=g) / 10**0.5
    return TensorDataset(x, x @ w)


def hundred_rows() -> TensorDataset:
    """100 rows: with 2 workers x 16 x 3 accumulation steps the last step has 4 rows for 6
    micro-batches, so some micro-batches are empty."""
    return TensorDataset(*regression()[:100])


class DictRows(torch.utils.data.Dataset):
    """Items as a user's pipeline makes them: ({"x": features, "bias": offset}, target),
    float64 as numpy gives (ray_ddp hands the model float32)."""

    def __init__(self):
        x, y = regression()[:]
        self.x, self.y = x.double(), y.double()

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"x": self.x[i], "bias": self.x[i, 0] * 0.0}, self.y[i]


def dict_rows() -> DictRows:
    return DictRows()



def collate_dicts(items):
    """A user's collate: stack the dict fields and targets itself."""
    inputs = {k: torch.stack([item[0][k] for item in items]) for k in items[0][0]}
    return inputs, torch.stack([item[1] for item in items])


class NumpyRegression:
    """A scikit-learn style regression set: items are (numpy float32 row, numpy float64
    scalar), so the batched target has shape (N,) against the model's (N, 1) output."""

    def __init__(self, rows: int, seed: int = 0, inputs: int = 6):
        import numpy as np

        rng = np.random.default_rng(seed)
        self.x = rng.normal(size=(rows, inputs)).astype("float32")
        w = np.arange(1, inputs + 1, dtype="float64")
        w *= (10.0 / (w ** 2).sum()) ** 0.5
        self.y = self.x.astype("float64") @ w  # Var(y) = sum(w^2) = 10

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i], self.y[i]
