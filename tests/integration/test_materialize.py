"""No rank but 0 builds the whole model: with more than one rank, rank 0 builds the
weights (and reads --init-from's), the others build the shapes on the meta device and
take rank 0's values, under FSDP shard by shard, under DDP in its own broadcast. Every
rank ends with exactly the weights and buffers one process builds from the same seed
(the path every rank took before), ties and buffers a state_dict leaves out included,
FSDP and DDP on 3 ranks; a rank other than 0 never holds the whole model under FSDP.

Real gloo process groups on loopback, no Ray: ray_ddp's own build
(worker/parts.py build_model_on_ranks); the real-Ray runs of the path are every
multi-worker run's. The slow lane: processes that train."""

from __future__ import annotations

import pytest
import torch

from dist_matrix import run_on_ranks
from materialize_ranks import Noted, write_hf

pytestmark = pytest.mark.ray

GPT = dict(vocab_size=32, width=16, depth=2, heads=2, seq_len=8)
NOTED = "materialize_ranks:Noted"
BIG = dict(input_dim=64, output_dim=8, width=1024, depth=16)  # 15.8M parameters: 60 MB in fp32


def test_only_rank_0_holds_the_whole_model_and_reads_init_from_into_it(tmp_path):
    """A 60 MB MLP over 3 ranks under FSDP, after a tiny one (what the libraries take the
    first time is not the model's): rank 0's peak rises by the whole model, the others'
    by less than 0.75 of it (a third, and one whole tensor at a time); every rank
    building it whole, theirs rose as much as rank 0's. With --init-from a safetensors
    file of it, rank 0's peak rises by less than a quarter of the model more (its tensors
    are read into the model's own; reading the state_dict first held half the model
    more), and every rank ends with the file's weights."""
    from safetensors.torch import save_file

    torch.manual_seed(5)
    saved = {k: v.contiguous() for k, v in _mlp().state_dict().items()}
    save_file(saved, str(tmp_path / "init.safetensors"))
    model_mb = sum(v.numel() for v in saved.values()) * 4 / 2**20
    tiny = ("mlp", "fsdp", None, dict(BIG, width=16, depth=2))
    built = run_on_ranks(3, _build, [tiny, ("mlp", "fsdp", None, BIG)])
    assert built[0][1]["grew_mb"] >= 0.9 * model_mb, (built[0][1]["grew_mb"], model_mb)
    assert max(r[1]["grew_mb"] for r in built[1:]) < 0.75 * model_mb, [r[1]["grew_mb"] for r in built]
    read = run_on_ranks(3, _build, [tiny, ("mlp", "fsdp", str(tmp_path / "init.safetensors"), BIG)])
    more = read[0][1]["grew_mb"] - built[0][1]["grew_mb"]
    assert more < 0.25 * model_mb, (more, model_mb)
    for rank in read:
        _assert_same(rank[1]["weights"], saved, "--init-from's weights")


def test_every_rank_gets_the_weights_one_process_builds(tmp_path):
    pytest.importorskip("transformers")
    llama, gpt2 = write_hf(str(tmp_path), "llama"), write_hf(str(tmp_path), "gpt2")
    init = tmp_path / "init.pt"
    torch.manual_seed(11)
    torch.save(Noted().state_dict(), init)
    cases = [("gpt", "fsdp", None, GPT), (f"hf:{llama}", "fsdp", None, {}),  # a rotary buffer
             (f"hf:{gpt2}", "fsdp", None, {}),  # a tied head
             (NOTED, "fsdp", None, {}), (NOTED, "fsdp", str(init), {}),
             ("gpt", "ddp", None, GPT), (f"hf:{llama}", "ddp", None, {}), (f"hf:{gpt2}", "ddp", None, {}),
             (NOTED, "ddp", str(init), {})]
    reference = run_on_ranks(1, _build, cases)[0]
    ranks = run_on_ranks(3, _build, cases)
    for (model, strategy, init_from, _), one, *each in zip(cases, reference, *ranks):
        for rank, got in enumerate(each):
            what = f"{model} ({strategy}, init {init_from}) on rank {rank} of 3"
            _assert_same(got["weights"], one["weights"], what)
            _assert_same(got["buffers"], one["buffers"], what + "'s buffers")
            assert got["parameters"] == one["parameters"], what  # a tie kept: as many parameters
            if model == NOTED:  # the model's own code: the whole weights on rank 0 only
                assert got["built_on"] == ("cpu" if rank == 0 else "meta"), what
    saved = torch.load(init, weights_only=True)
    assert torch.equal(reference[4]["weights"]["body.0.weight"], saved["body.0.weight"])


def _assert_same(got: dict, want: dict, what: str) -> None:
    assert got.keys() == want.keys(), what
    for name in want:
        assert torch.equal(got[name], want[name]), f"{what}: {name} differs"


def _mlp():
    from ray_ddp.models.builtin import build_mlp

    return build_mlp(BIG["input_dim"], BIG["output_dim"], BIG["width"], BIG["depth"])


def _build(rank, world, cases):
    from materialize_ranks import build_cases

    return build_cases(rank, world, cases)
