"""A Hugging Face GPT-2 trained with ray_ddp, as it comes: built from a GPT2Config (nothing
downloaded), items ({"input_ids", "labels"}, ids), its own loss as the objective, padded
batches of different lengths, then exported as a from_pretrained folder.

    pip install -e ".[hf]"
    python examples/hf_gpt2.py --workers 2 --epochs 3
    python examples/hf_gpt2.py --epochs 1 --text-bytes 20000 --storage /tmp/runs   # a minute on a laptop
"""

from __future__ import annotations

import argparse

import torch
from torch.utils.data import Dataset

import ray_ddp
from ray_ddp import TrainConfig

VOCAB = 256  # bytes of text


class Bytes(Dataset):
    """Windows of a text's bytes, 16 to 64 long: dict items the model takes as keywords."""

    def __init__(self, text: bytes, seed: int):
        g = torch.Generator().manual_seed(seed)
        data = torch.tensor(list(text))
        self.items = []
        for start in range(0, len(data) - 65, 48):
            n = int(torch.randint(16, 65, (1,), generator=g))
            ids = data[start:start + n]
            self.items.append(({"input_ids": ids, "labels": ids}, ids))

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        return self.items[i]


def make_model():
    from transformers import GPT2Config, GPT2LMHeadModel

    return GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_positions=64, n_embd=128, n_layer=4, n_head=4,
                                      bos_token_id=0, eos_token_id=0))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--storage", default="~/ray_ddp_runs")
    parser.add_argument("--text-bytes", type=int, default=400_000, help="bytes of text to train on")
    args = parser.parse_args()
    import pydoc_data.topics  # English text that ships with Python

    text = "".join(pydoc_data.topics.topics.values()).encode()
    cfg = TrainConfig(workers=args.workers, epochs=args.epochs, batch_size=16, optimizer="adamw", lr=1e-3,
                      storage=args.storage, name="hf-gpt2-example",
                      collate="ray_ddp.data.collate:pad_sequences")
    n = args.text_bytes
    summary = ray_ddp.run(cfg, model=make_model, train_data=Bytes(text[:n], 0),
                          val_data=Bytes(text[n:n + max(n // 10, 2_000)], 1))
    print(f"validation perplexity {summary.val_perplexity:.2f}; checkpoint {summary.checkpoint}")
    print(f"export it: ray-ddp export {summary.run} --storage {args.storage} --format hf --out ./gpt2-bytes")


if __name__ == "__main__":
    main()
