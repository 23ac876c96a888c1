"""Fixtures of the unit tests (no Ray)."""

import socket

import pytest
import torch.distributed as dist


@pytest.fixture(scope="session")
def one_rank_group():
    """A real gloo process group of one rank in this process, on loopback."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()
