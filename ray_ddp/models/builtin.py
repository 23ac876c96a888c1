"""The built-in models: the PyTorch DDP tutorial's ToyModel and its two-stage
ToyMpModel, an MLP, and a small GPT. Each declares its own FSDP units; the GPT can also
recompute its blocks in backward (``--activation-checkpointing``). Runs on the driver
(on the meta device) and on workers.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint


class ToyModel(nn.Module):
    """The tutorial's network: Linear(in, 10) -> ReLU -> Linear(10, out)."""

    def __init__(self, input_dim: int = 10, output_dim: int = 5, hidden: int = 10):
        super().__init__()
        self.net1 = nn.Linear(input_dim, hidden)
        self.relu = nn.ReLU()
        self.net2 = nn.Linear(hidden, output_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net2(self.relu(self.net1(x)))


class ToyMpModel(nn.Module):
    """ToyModel split in two stages: stage 1 on ``dev0``, stage 2 on ``dev1``.

    Parameter names match ToyModel's, so a checkpoint of one loads into the other.
    Activations hop from dev0 to dev1 in forward; the output lives on dev1.
    """

    def __init__(self, dev0: torch.device, dev1: torch.device, input_dim: int = 10,
                 output_dim: int = 5, hidden: int = 10):
        super().__init__()
        self.dev0, self.dev1 = torch.device(dev0), torch.device(dev1)
        self.net1 = nn.Linear(input_dim, hidden).to(self.dev0)
        self.relu = nn.ReLU()
        self.net2 = nn.Linear(hidden, output_dim).to(self.dev1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.relu(self.net1(x.to(self.dev0)))
        return self.net2(x.to(self.dev1))


def build_mlp(input_dim: int, output_dim: int, width: int, depth: int) -> nn.Sequential:
    """A plain MLP: ``depth`` hidden layers of ``width`` units with GELU."""
    layers: list[nn.Module] = []
    dim = input_dim
    for _ in range(depth):
        layers += [nn.Linear(dim, width), nn.GELU()]
        dim = width
    layers.append(nn.Linear(dim, output_dim))
    return nn.Sequential(*layers)


class Block(nn.Module):
    """A pre-norm transformer block: causal self-attention, then an MLP, each residual."""

    def __init__(self, width: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.ln2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows, seq, width = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(width, dim=2)
        q, k, v = (t.view(rows, seq, self.heads, width // self.heads).transpose(1, 2) for t in (q, k, v))
        att = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(rows, seq, width))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """A small decoder-only transformer: token and position embeddings, ``depth`` blocks,
    a final LayerNorm, and an output layer that shares the token embedding's weights."""

    def __init__(self, vocab_size: int, width: int, depth: int, heads: int, seq_len: int):
        super().__init__()
        self.tokens = nn.Embedding(vocab_size, width)
        self.positions = nn.Embedding(seq_len, width)
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(depth))
        self.ln = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab_size, bias=False)
        self.head.weight = self.tokens.weight  # weight tying
        # a plain attribute, not a buffer: the state_dict keys stay as they were, so
        # checkpoints load whether it is on or off
        self.activation_checkpointing = False
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=0.02)
                if getattr(module, "bias", None) is not None:
                    nn.init.zeros_(module.bias)

    def fsdp_units(self) -> list[nn.Module]:
        """What FSDP shards as one unit each: the transformer blocks."""
        return list(self.blocks)

    def set_activation_checkpointing(self, enabled: bool = True) -> None:
        """Recompute each block's activations in backward instead of keeping them: the
        forward keeps only each block's input (less memory, one more block forward)."""
        self.activation_checkpointing = enabled

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(ids.shape[1], device=ids.device)
        x = self.tokens(ids) + self.positions(positions)
        # only when a backward will come: validation (no_grad) and eval() keep nothing anyway
        recompute = self.activation_checkpointing and self.training and torch.is_grad_enabled()
        for block in self.blocks:
            # use_reentrant=False: the form PyTorch recommends; it works with DDP's hooks,
            # FSDP2's per-block all-gathers and inputs that need no grad
            x = checkpoint(block, x, use_reentrant=False) if recompute else block(x)
        return self.head(self.ln(x))
