"""Fixtures for real runs: a small config and one uninterrupted reference run."""

from __future__ import annotations

import pytest

from ray_ddp import run

from ray_ddp.data.synth_files import write_synthetic

from tests.conftest import integration_group

from ._runs import full_config


@pytest.fixture(scope="session")
def storage(tmp_path_factory):
    return tmp_path_factory.mktemp("runs")


@pytest.fixture(scope="session")
def full_val(tmp_path_factory):
    """full_run's validation rows (the synthetic data's shape)."""
    path = tmp_path_factory.mktemp("full-val") / "val"
    write_synthetic(str(path), rows=50, features=10, targets=5)
    return str(path)


@pytest.fixture(scope="session")
def full_story(ray_local, storage, full_val):
    """One uninterrupted 3-epoch toy run, and the lines it said: the reference that
    interrupted runs must match (a straggling rank, validation, TensorBoard and a file://
    URI leave its weights as they are), and the run test_observe.py's straggler and
    TensorBoard, W&B and Ray-metrics claims ride on (each Ray Train start costs ~15 s of a
    2-core machine). Ray's Prometheus endpoint is read while it trains: the series seen."""
    import ray
    from prometheus import scraping

    port = next(n["MetricsExportPort"] for n in ray.nodes() if n["Alive"])
    lines: list[str] = []
    with scraping(port) as series:
        summary = run(full_config(storage, full_val), echo=lines.append)
    return summary, lines, series


@pytest.fixture(scope="session")
def full_run(full_story):
    return full_story[0]


@pytest.fixture(scope="session")
def mlflow_uri(tmp_path_factory):
    """One real MLflow tracking server for the suite (test_hangs.py, test_mlflow_server.py)."""
    from mlflow_server import mlflow_server

    with mlflow_server(tmp_path_factory.mktemp("mlflow")) as uri:
        yield uri


@pytest.fixture(scope="session")
def multinode(tmp_path_factory, ray_local):
    """test_multinode.py's two-node cluster, and its elastic story and jobs running on it in a thread."""
    from .test_multinode import cluster_and_story

    yield from cluster_and_story(tmp_path_factory)


@pytest.fixture(scope="session")
def hang_story(tmp_path_factory, ray_local, storage, mlflow_uri):
    """test_hangs.py's two commands, running in a thread on the shared Ray."""
    from .test_hangs import start_hang_story

    started = start_hang_story(storage, tmp_path_factory.mktemp("hang"), mlflow_uri)
    yield started
    started[0].join(timeout=600)  # never leave it running past the shared Ray


@pytest.fixture(scope="session")
def tune_story(tmp_path_factory, ray_local, storage, mlflow_uri):
    """test_tune.py's search file, and its search running in a thread on the shared Ray."""
    from .test_tune import start_search

    search_file, started = start_search(storage, tmp_path_factory.mktemp("tune"), mlflow_uri)
    yield search_file, started
    started[0].join(timeout=600)


@pytest.fixture(scope="session")
def default_job(tmp_path_factory):
    """test_cli.py's `ray-ddp train --json`, a process of its own (with a Ray of its own)."""
    from .test_cli import start_default_job

    proc, home = start_default_job(tmp_path_factory.mktemp("default-job"))
    yield proc, home
    if proc.poll() is None:
        proc.kill()
        proc.wait()


# Stories that spend most of their minutes waiting (on a drain's deadline, on Ray's
# restarts, on the hang watch's timeouts, on Tune, on a Ray of its own): when their module is among the tests, each
# starts with the first integration test of the stories' group (tests/conftest.py's
# integration_group) and runs beside the others, which fill its waits with their work
# (they share the CPUs and, but for the multinode cluster, the Ray).
EARLY_STORIES = {"test_multinode": "multinode", "test_hangs": "hang_story", "test_tune": "tune_story",
                 "test_cli": "default_job"}


@pytest.fixture(autouse=True)
def _start_the_waiting_stories_early(request):
    if integration_group(request.node.nodeid) == "stories":  # never in the process beside them
        request.getfixturevalue("_waiting_stories")


@pytest.fixture(scope="session")
def _waiting_stories(request):
    modules = {item.module.__name__.rsplit(".", 1)[-1] for item in request.session.items}
    for module, fixture in EARLY_STORIES.items():
        if module in modules:
            try:
                request.getfixturevalue(fixture)
            except Exception:  # pytest keeps the error: the story's own tests report it, no other test
                pass
