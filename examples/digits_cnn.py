"""Image classification on real data: scikit-learn's handwritten digits (1,797 8x8 images
that ship inside the package; nothing is downloaded), a small CNN with BatchNorm, 2 DDP
workers, validation on a held-out fifth every epoch.

    pip install -e ".[examples]"
    python examples/digits_cnn.py [--workers 2] [--epochs 15] [--storage ~/ray_ddp_runs]
"""

import argparse

import torch
from torch import nn

import ray_ddp


class DigitsCNN(nn.Module):
    """conv-BN-ReLU x 2, global average pool, a linear head: 10 classes."""

    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(),
            nn.Conv2d(32, 64, 3, padding=1), nn.BatchNorm2d(64), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(64, 64, 3, padding=1), nn.BatchNorm2d(64), nn.ReLU(),
        )
        self.head = nn.Linear(64, 10)

    def forward(self, images):
        return self.head(self.features(images).mean(dim=(2, 3)))


def digits():
    """The digits as (image, label) pairs: 1x8x8 float images scaled to [0, 1]."""
    from sklearn.datasets import load_digits

    data = load_digits()
    images = torch.tensor(data.images, dtype=torch.float32).unsqueeze(1) / 16.0
    return torch.utils.data.TensorDataset(images, torch.tensor(data.target))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=15)
    parser.add_argument("--storage", default="~/ray_ddp_runs")
    parser.add_argument("--name", default="digits-cnn")
    args = parser.parse_args()
    cfg = ray_ddp.TrainConfig(workers=args.workers, epochs=args.epochs, batch_size=64,
                              optimizer="adamw", lr=0.003, schedule="cosine", warmup_steps=10,
                              val_fraction=0.2, keep_best=True, storage=args.storage, name=args.name)
    summary = ray_ddp.run(cfg, model=DigitsCNN, train_data=digits())
    print(f"digits: validation accuracy {summary.val_accuracy:.4f} (loss {summary.val_loss:.4f}) "
          f"after {summary.epochs_completed} epochs in {summary.wall_time_s:.0f} s")


if __name__ == "__main__":
    main()
