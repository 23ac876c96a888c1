"""torch's pytree (torch.utils._pytree, private: torch 2.13 has no public one), which
tasks/batches.py alone imports: pinned to the torch it was checked against, and what
ray_ddp relies on it for (a batch's nested dicts, tuples and a Hugging Face ModelOutput
walked leaf by leaf)."""

from __future__ import annotations

import inspect

import pytest
import torch

from ray_ddp.tasks import batches
from ray_ddp.worker import collectives


def test_the_private_pytree_is_where_batches_reads_it_on_the_torch_checked():
    from torch.utils import _pytree

    assert torch.__version__.startswith(collectives.CHECKED_TORCH + "."), (
        f"tasks/batches.py's pytree was checked against torch {collectives.CHECKED_TORCH}; this is torch "
        f"{torch.__version__}: check torch.utils._pytree (or a public pytree) still walks batches the same")
    assert batches.tree_map is _pytree.tree_map and batches.tree_leaves is _pytree.tree_leaves
    assert list(inspect.signature(_pytree.tree_map).parameters)[:2] == ["func", "tree"]


def test_nested_batches_and_model_outputs_are_walked_leaf_by_leaf():
    CausalLMOutput = pytest.importorskip("transformers.modeling_outputs").CausalLMOutput

    batch = {"ids": torch.ones(2, 3), "extra": (torch.zeros(2), [torch.ones(1)]), "name": "x"}
    doubled = batches.tree_map(lambda t: t * 2 if isinstance(t, torch.Tensor) else t, batch)
    assert doubled["ids"].eq(2).all() and doubled["extra"][1][0].item() == 2 and doubled["name"] == "x"
    out = CausalLMOutput(loss=torch.tensor(1.0), logits=torch.ones(2, 3))
    assert len([t for t in batches.tree_leaves(out) if isinstance(t, torch.Tensor)]) == 2
