"""--init-from's weights read into the model rank 0 built (models/init.py
load_init_weights): every file kind gives the weights the file holds, a tied pair
stays one tensor, a file of another dtype is cast, keys the model lacks are skipped
(--init-strict false) and its own keys the file lacks keep their init; a cut-short
safetensors file is one line, not a model half read."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ray_ddp.errors import ConfigError
from ray_ddp.models.init import apply_init_weights, load_init_weights

safetensors = pytest.importorskip("safetensors.torch")


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, 4)
        self.body = nn.Linear(4, 4)
        self.norm = nn.BatchNorm1d(4)
        self.head = nn.Linear(4, 10, bias=False)
        self.head.weight = self.emb.weight  # tied


def trained() -> dict[str, torch.Tensor]:
    torch.manual_seed(1)
    net = Net()
    with torch.no_grad():
        net.norm.running_mean.add_(3.0)
    return {k: v for k, v in net.state_dict().items() if k != "head.weight"}  # save_pretrained drops the tie


@pytest.mark.parametrize("kind", ["safetensors", "bf16 safetensors", "torch", "sharded safetensors"])
def test_each_file_kind_gives_the_files_weights(tmp_path, kind):
    want = trained()
    if kind == "torch":
        path = tmp_path / "model.pt"
        torch.save(want, path)
    elif kind == "sharded safetensors":  # a save_pretrained folder in two files
        path = tmp_path / "hf"
        path.mkdir()
        keys = sorted(want)
        safetensors.save_file({k: want[k] for k in keys[:2]}, str(path / "model-00001-of-00002.safetensors"))
        safetensors.save_file({k: want[k] for k in keys[2:]}, str(path / "model-00002-of-00002.safetensors"))
    else:
        path = tmp_path / "model.safetensors"
        stored = {k: v.to(torch.bfloat16) if kind.startswith("bf16") and v.is_floating_point() else v
                  for k, v in want.items()}
        safetensors.save_file(stored, str(path))
        want = {k: v.to(want[k].dtype) for k, v in stored.items()}
    torch.manual_seed(2)
    net = Net()
    apply_init_weights(net, str(path), True)
    got = net.state_dict()
    for key, value in want.items():
        assert torch.equal(got[key], value), key
    assert net.head.weight is net.emb.weight and torch.equal(got["head.weight"], want["emb.weight"])


def test_keys_the_model_lacks_are_skipped_and_its_own_keep_their_init(tmp_path):
    safetensors.save_file({"body.weight": torch.ones(4, 4), "old_head.weight": torch.ones(3, 4)},
                          str(tmp_path / "part.safetensors"))
    torch.manual_seed(2)
    net = Net()
    before = {k: v.clone() for k, v in net.state_dict().items()}
    apply_init_weights(net, str(tmp_path / "part.safetensors"), False)
    after = net.state_dict()
    assert torch.equal(after["body.weight"], torch.ones(4, 4))
    assert all(torch.equal(after[k], before[k]) for k in before if k != "body.weight")


def test_a_cut_short_safetensors_file_is_one_line(tmp_path):
    path = tmp_path / "model.safetensors"
    safetensors.save_file(trained(), str(path))
    data = path.read_bytes()
    path.write_bytes(data[:-8])  # the last tensor's last bytes gone
    with pytest.raises(ConfigError, match="the file ends inside tensor .*; it is cut short"):
        load_init_weights(Net(), str(path))
