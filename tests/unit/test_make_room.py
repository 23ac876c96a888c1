"""parallel/materialize.py's make_room: a model built on the meta device given memory as
the one rank 0 built is laid out: a tensor held under two names is one tensor again,
parameter or buffer, and a shared buffer kept out of the state_dict stays out."""

from __future__ import annotations

import torch
from torch import nn

from ray_ddp.parallel.materialize import make_room, on_meta


class Shares(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)
        self.b.weight = self.a.weight  # a tied parameter
        table = torch.arange(4.0)
        self.a.register_buffer("table", table, persistent=False)  # a cache both use, not saved
        self.b.register_buffer("table", table, persistent=False)
        stats = torch.zeros(4)
        self.a.register_buffer("stats", stats)  # a saved buffer under two names
        self.b.register_buffer("stats", stats)


def test_ties_and_shared_buffers_survive_and_state_dict_keys_are_rank_0s():
    whole = Shares()
    with torch.device("meta"):
        shapes = Shares()
    assert on_meta(shapes)
    make_room(shapes, torch.device("cpu"))
    assert not on_meta(shapes)
    assert shapes.b.weight is shapes.a.weight
    assert shapes.b.table is shapes.a.table and shapes.b.stats is shapes.a.stats
    assert list(shapes.state_dict()) == list(whole.state_dict())  # no cache became a saved key
    assert len(list(shapes.parameters())) == len(list(whole.parameters()))


def test_a_model_with_values_is_left_as_it_is():
    model = Shares()
    weight = model.a.weight
    make_room(model, torch.device("cpu"))
    assert model.a.weight is weight
