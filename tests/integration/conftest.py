"""Fixtures for real runs: a small config and one uninterrupted reference run."""

from __future__ import annotations

import pytest

from ray_ddp import run

from ._runs import small


@pytest.fixture(scope="session")
def storage(tmp_path_factory):
    return tmp_path_factory.mktemp("runs")


@pytest.fixture(scope="session")
def full_run(ray_local, storage):
    """One uninterrupted 3-epoch toy run: the reference that interrupted runs must match."""
    return run(small(storage, "full"))
