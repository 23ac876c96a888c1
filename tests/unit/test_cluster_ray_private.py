"""Ray's private names that cluster/ray_private.py holds, pinned: the Ray they were
checked against, and each name's place and parameters in the Ray installed (no Ray is
started). On an upgrade that moves them this fails here, by name, before a run on a
cluster finds out."""

from __future__ import annotations

import inspect

import ray

from ray_ddp.cluster import ray_private


def params(fn) -> list[str]:
    # less the _ray_trace_ctx that Ray adds to an actor's methods once a Ray has started in
    # this process (the whole suite runs the integration tests first)
    return [p for p in inspect.signature(fn).parameters if p != "_ray_trace_ctx"]


def test_the_ray_installed_is_the_one_the_adapter_was_checked_against():
    assert ray.__version__ == ray_private.CHECKED_RAY, (
        f"cluster/ray_private.py was checked against Ray {ray_private.CHECKED_RAY}; this is Ray "
        f"{ray.__version__}: check the names below still exist and mean the same, then update CHECKED_RAY")


def test_the_address_auto_stands_for():
    from ray._private import services

    assert params(services.canonicalize_bootstrap_address) == ["addr", "temp_dir"]


def test_the_autoscaler_records_preflight_reads():
    from ray._private import ray_constants, state
    from ray.core.generated import autoscaler_pb2
    from ray.experimental import internal_kv

    assert params(state.state.get_cluster_config) == []
    group = autoscaler_pb2.ClusterConfig().node_group_configs.add()
    assert {"resources", "max_count"} <= {f.name for f in group.DESCRIPTOR.fields}
    assert params(internal_kv._internal_kv_get)[0] == "key"
    assert ray_private.V1_STATUS_KEY == ray_constants.DEBUG_AUTOSCALING_STATUS


def test_the_autoscaling_coordinator_refreshed_at_the_start():
    from ray.data._internal.cluster_autoscaler import default_autoscaling_coordinator as coordinator

    assert params(coordinator.get_or_create_autoscaling_coordinator) == []
    assert params(coordinator._AutoscalingCoordinatorActor.get_reserved_resources) == [
        "self", "requester_id", "recompute"]


def test_a_moved_name_fails_with_one_line_naming_both_rays():
    err = ray_private.moved("the AutoscalingCoordinator", ImportError("No module named 'x'"))
    assert isinstance(err, ImportError) and "\n" not in str(err)
    assert ray_private.CHECKED_RAY in str(err) and f"Ray {ray.__version__}" in str(err)


def test_what_the_adapter_makes_of_the_records(monkeypatch):
    from types import SimpleNamespace

    from ray.core.generated import autoscaler_pb2

    config = autoscaler_pb2.ClusterConfig()
    monkeypatch.setattr(ray_private._ray_state, "state", SimpleNamespace(get_cluster_config=lambda: config))
    assert ray_private.autoscaler_node_groups() is None  # published, but no node types
    group = config.node_group_configs.add()
    group.resources["GPU"], group.max_count = 8, -1
    assert ray_private.autoscaler_node_groups() == [({"GPU": 8}, -1)]
    monkeypatch.setattr(ray_private, "_internal_kv_get", lambda key: None)
    assert ray_private.v1_autoscaler_status() is None
    monkeypatch.setattr(ray_private, "_internal_kv_get",
                        lambda key: b'{"autoscaler_report": {}}' if key == ray_private.V1_STATUS_KEY else None)
    assert ray_private.v1_autoscaler_status() == {"autoscaler_report": {}}
