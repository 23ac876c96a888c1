"""Shared test fixtures. Unit tests need none of these and never start Ray."""

from __future__ import annotations

import os
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
# tests/helpers holds user models/datasets that workers import as package.module:callable;
# Ray ships the driver's sys.path to its workers, so this reaches them too.
sys.path.insert(0, os.path.join(HERE, "helpers"))


@pytest.fixture(scope="session")
def ray_local():
    """One real local Ray for every in-process integration test (starting Ray costs ~10 s)."""
    import ray

    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False,
             logging_level="ERROR", _node_ip_address="127.0.0.1")  # listen on loopback only
    yield ray
    ray.shutdown()
