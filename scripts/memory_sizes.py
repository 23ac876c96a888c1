"""Memory per rank on paper: the training state a rank holds under ddp, fsdp and hsdp, and
the host memory a node spends building the model, for 1B, 7B and 13B models on one
8 x 80 GB box and on four. The table in docs/fsdp.md is this script's output
(tests/unit/test_memory_sizes.py keeps them equal, and checks the formula against the
CPU peaks benchmarks/fsdp_memory.py measured, result files in benchmarks/results).

The formula counts the training state only, in fp32 as ray_ddp keeps it (``--amp bf16``
computes in bf16 over fp32 weights): weights 4 bytes a parameter, gradients 4, AdamW's
two moments 8 (SGD's momentum 4). DDP holds all of it on every rank; FSDP 1/world of it;
HSDP 1/shard group (a node's ranks by default). Left out: activations (batch and
sequence decide them; --activation-checkpointing cuts them), the gathered unit FSDP
holds while it computes (one block, in bf16 under --amp bf16), and the libraries' own
memory (CUDA context, NCCL buffers: ~1-3 GB a GPU).

At start, only rank 0 builds the whole model in host memory (4 bytes a parameter; a
Hugging Face folder's tensors as it reads them); the other ranks build on the meta device
and receive their part: under fsdp/hsdp their shards, straight onto their GPU.

    python scripts/memory_sizes.py              # prints the table (markdown)
"""

from __future__ import annotations

import sys

GB = 1e9
STATE_BYTES = {"adamw": 16, "sgd": 12}  # per parameter: weights, gradients, the optimizer's state
MODELS = (("1B", 1e9), ("7B", 7e9), ("13B", 13e9))
# (what, world size, ranks a node): one 8-GPU box, four of them
CLUSTERS = (("one 8 x 80 GB box", 8, 8), ("four 8 x 80 GB boxes", 32, 8))
GPU_GB = 80


def sharing(strategy: str, world: int, per_node: int) -> int:
    """How many ranks share one copy of the training state."""
    return {"ddp": 1, "fsdp": world, "hsdp": per_node}[strategy]


def state_per_rank(params: float, strategy: str, world: int, per_node: int, optimizer: str = "adamw") -> float:
    """Bytes of training state each rank holds."""
    return params * STATE_BYTES[optimizer] / sharing(strategy, world, per_node)


def host_at_start(params: float, per_node: int, every_rank_builds: bool = False) -> float:
    """Host bytes rank 0's node spends on the model at start: rank 0's whole fp32 copy
    (every rank's, as before ray_ddp built it once)."""
    return params * 4 * (per_node if every_rank_builds else 1)


def render_table() -> str:
    lines = ["| model | cluster | ddp GB/GPU | fsdp GB/GPU | hsdp GB/GPU | host GB at start, rank 0's node "
             "(every rank building it) |", "|---|---|---|---|---|---|"]
    for name, params in MODELS:
        for where, world, per_node in CLUSTERS:
            cells = []
            for strategy in ("ddp", "fsdp", "hsdp"):
                gb = state_per_rank(params, strategy, world, per_node) / GB
                cells.append(f"{gb:,.1f}" + (" (does not fit)" if gb > GPU_GB else ""))
            host = f"{host_at_start(params, per_node) / GB:,.0f} ({host_at_start(params, per_node, True) / GB:,.0f})"
            lines.append(f"| {name} | {where} | {' | '.join(cells)} | {host} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    sys.stdout.write(render_table())
    return 0


if __name__ == "__main__":
    sys.exit(main())
