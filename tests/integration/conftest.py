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


@pytest.fixture(scope="session")
def mlflow_uri(tmp_path_factory):
    """One real MLflow tracking server for the suite (test_hangs.py, test_mlflow_server.py)."""
    from mlflow_server import mlflow_server

    with mlflow_server(tmp_path_factory.mktemp("mlflow")) as uri:
        yield uri


@pytest.fixture(scope="session")
def multinode(tmp_path_factory, ray_local):
    """test_multinode.py's two-node cluster, and its elastic story running on it in a thread."""
    from .test_multinode import cluster_and_story

    yield from cluster_and_story(tmp_path_factory)


@pytest.fixture(scope="session", autouse=True)
def _start_the_multinode_story_early(request):
    """The elastic story takes about 4.5 minutes, most of them waiting on Ray: when
    test_multinode.py is among the tests, it starts with the first integration test and
    runs beside the others (they share the CPUs, not a Ray)."""
    if any(item.module.__name__.endswith("test_multinode") for item in request.session.items):
        request.getfixturevalue("multinode")
