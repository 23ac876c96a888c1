"""The model's own loss is exact however the global batch is cut, for the field's heads,
DDP and FSDP: 8 ragged rows (labels of different lengths, rows with no label token, and
one rank's whole second micro-batch with none: prompt-only rows) trained one step by
ray_ddp's own step on 1 worker x 8 rows and on 2 workers x 2 micro-batches of 2 rows,
against one plain process taking the model's own loss over all 8 rows at once. The same
weights, to float tolerance: this is the test that catches a mis-weighted head, a NaN
from an empty or prompt-only micro-batch, and an accumulation or world-size cut that
counts wrong.

Real gloo process groups on loopback, no Ray (the arithmetic is ray_ddp's own; the
real-Ray runs of this path are test_hf.py's). The slow lane: processes that train."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from dist_matrix import one_step, run_on_ranks  # noqa: E402
from hf_tiny import rows, tiny  # noqa: E402

pytestmark = pytest.mark.ray

KINDS = ("gpt2", "llama", "t5", "rows", "token", "choice", "custom")
CASES = [(kind, strategy) for kind in KINDS for strategy in ("ddp", "fsdp")]
GLOBAL_ROWS = 8


def reference(kind: str) -> dict[str, torch.Tensor]:
    """One plain process: the model's own loss over the whole global batch, one SGD step."""
    model = tiny(kind)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    out = model(**rows(kind, GLOBAL_ROWS))
    loss = out["loss"] if isinstance(out, dict) else out.loss
    loss.backward()
    optimizer.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.fixture(scope="module")
def stepped():
    """Both cuts, each in its own process group: {world: rank 0's weights per case}."""
    return {world: run_on_ranks(world, one_step, CASES, GLOBAL_ROWS, micro)[0]
            for world, micro in ((1, 1), (2, 2))}


@pytest.mark.parametrize("kind", KINDS)
def test_every_cut_gives_the_weights_of_the_single_process_reference(stepped, kind):
    want = reference(kind)
    assert not all(torch.isnan(w).any() for w in want.values())
    for world in (1, 2):
        for strategy in ("ddp", "fsdp"):
            got = stepped[world][(kind, strategy)]
            assert set(got) == set(want)
            for name, weight in want.items():
                torch.testing.assert_close(got[name], weight, rtol=1e-4, atol=1e-5,
                                           msg=lambda m: f"{kind} {strategy} world {world} {name}: {m}")
