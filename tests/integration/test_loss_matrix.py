"""A loss is exact however the global batch is cut, for the field's heads and ray_ddp's
own tasks, DDP and FSDP. The heads' own losses on 8 ragged rows (labels of different
lengths, rows with no label token, and one rank's whole second micro-batch with none:
prompt-only rows), a GPT-2 under --lora's adapters among them; ray_ddp's cross-entropy and mean squared error on its MLP over 7 rows
(micro-batches of 2 and 1 rows). Each trained one step by ray_ddp's own step on 1 worker
taking the whole batch, on 2 workers x 2 micro-batches, and under HSDP on 4 workers (2
replicas x 2 shards), against one plain process
taking the loss over all the rows at once. The same weights, to float tolerance: this is
the test that catches a mis-weighted head, a NaN from an empty or prompt-only
micro-batch, and an accumulation or world-size cut that counts wrong.

Real gloo process groups on loopback, no Ray (the arithmetic is ray_ddp's own; the
real-Ray runs of this path are test_hf.py's and test_tasks.py's). The slow lane:
processes that train."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from dist_matrix import one_step, run_on_ranks  # noqa: E402
from hf_tiny import BUILTIN, rows, tiny  # noqa: E402

pytestmark = pytest.mark.ray

KINDS = ("gpt2", "llama", "t5", "rows", "token", "choice", "custom", "gpt2-lora", *BUILTIN)
CASES = [(kind, strategy) for kind in KINDS for strategy in ("ddp", "fsdp")]
GLOBAL_ROWS = 8


def reference(kind: str) -> dict[str, torch.Tensor]:
    """One plain process: the model's own loss over the whole global batch, one SGD step."""
    model = tiny(kind)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    batch = rows(kind, GLOBAL_ROWS)
    if kind in BUILTIN:  # ray_ddp's own task: its loss, over all the rows at once
        loss = BUILTIN[kind][1](model(batch["inputs"]), batch["labels"])
    else:
        out = model(**batch)
        loss = out["loss"] if isinstance(out, dict) else out.loss
    loss.backward()
    optimizer.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.fixture(scope="module")
def stepped():
    """Each cut in its own process group: {world: rank 0's weights per case}; 4 ranks:
    HSDP, 2 replicas of 2 shards, a micro-batch each."""
    out = {world: run_on_ranks(world, one_step, CASES, GLOBAL_ROWS, micro)[0] for world, micro in ((1, 1), (2, 2))}
    out[4] = run_on_ranks(4, one_step, [(kind, "hsdp") for kind in KINDS], GLOBAL_ROWS, 1)[0]
    return out


@pytest.mark.parametrize("kind", KINDS)
def test_every_cut_gives_the_weights_of_the_single_process_reference(stepped, kind):
    want = reference(kind)
    assert not all(torch.isnan(w).any() for w in want.values())
    for world, strategies in ((1, ("ddp", "fsdp")), (2, ("ddp", "fsdp")), (4, ("hsdp",))):
        for strategy in strategies:
            got = stepped[world][(kind, strategy)]
            assert set(got) == set(want)
            for name, weight in want.items():
                torch.testing.assert_close(got[name], weight, rtol=1e-4, atol=1e-5,
                                           msg=lambda m: f"{kind} {strategy} world {world} {name}: {m}")


EMPTY_FIRST = [(kind, strategy) for kind in ("gpt2", "rows", "classify") for strategy in ("ddp", "fsdp")]


def test_a_fresh_rank_whose_first_micro_batch_is_empty_gives_the_reference_weights():
    """A worker (re)started at an epoch's last step, or data smaller than the ranks: its
    first micro-batch has no rows, and it has trained on none to stand in for them (a
    GPT-2 cannot reshape 0 rows). The source's own stand-in row runs instead, adding nothing."""
    from dist_matrix import one_step as step

    got = run_on_ranks(2, step, EMPTY_FIRST, GLOBAL_ROWS, 2, True)[0]
    for kind, strategy in EMPTY_FIRST:
        for name, weight in reference(kind).items():
            torch.testing.assert_close(got[(kind, strategy)][name], weight, rtol=1e-4, atol=1e-5,
                                       msg=lambda m: f"{kind} {strategy} {name}: {m}")


@pytest.mark.parametrize("strategy", ("ddp", "fsdp"))
def test_a_step_with_no_unit_on_any_rank_leaves_the_weights_as_they_were(strategy):
    """Every label -100 on every rank: no data, so no update (AdamW would still move the
    weights by its momentum and weight decay)."""
    from dist_matrix import a_step_without_units

    before, after = run_on_ranks(2, a_step_without_units, strategy)[0]
    for name, weight in before.items():
        assert torch.equal(after[name], weight), name
