"""Ray's private names that cluster/ needs, imported in this one place. Runs on the
driver (attach.py and preflight.py call it).

None has a public equivalent in Ray: the address ``auto`` stands for (``ray.init``
finds it only by connecting, and retries a dead one for minutes), the node types an
autoscaler may launch and the v1 monitor's status (``ray status`` reads the same
records), and the AutoscalingCoordinator that Ray Train's elastic policy asks. ray_ddp
was checked against the Ray below; on another, a moved name fails here with one line
saying so, and tests/unit/test_cluster_ray_private.py pins the names and signatures used.
"""

from __future__ import annotations

import json
from typing import Any, Optional

CHECKED_RAY = "2.60.0"

# the key the v1 monitor publishes its status under (ray_constants.DEBUG_AUTOSCALING_STATUS)
V1_STATUS_KEY = "__autoscaling_status"


def moved(what: str, err: Exception) -> ImportError:
    """The one line a moved name fails with."""
    import ray

    return ImportError(f"ray_ddp reads {what} through Ray's private API, checked against Ray "
                       f"{CHECKED_RAY}; Ray {ray.__version__} moved it ({err})")


try:
    from ray._private.services import canonicalize_bootstrap_address
    from ray._private import state as _ray_state
    from ray.experimental.internal_kv import _internal_kv_get
except ImportError as err:  # pragma: no cover - only on a Ray that moved them
    raise moved("the cluster's address and autoscaler", err) from None


def auto_address() -> Optional[str]:
    """The GCS address (host:port) that ``--address auto`` means: RAY_ADDRESS, else the
    cluster ``ray start`` last started on this machine; None when there is none."""
    return canonicalize_bootstrap_address("auto")


def autoscaler_node_groups() -> Optional[list[tuple[dict[str, float], int]]]:
    """(resources, max_count) of each node type autoscaler v2 published to the GCS (the
    record Ray Train's own check reads); None when none was published."""
    config: Any = _ray_state.state.get_cluster_config()
    if config is None or not config.node_group_configs:
        return None
    return [(dict(g.resources), int(g.max_count)) for g in config.node_group_configs]


def v1_autoscaler_status() -> Optional[dict[str, Any]]:
    """The status the v1 monitor publishes (what ``ray status`` prints), or None."""
    status = _internal_kv_get(V1_STATUS_KEY)
    return json.loads(status) if status else None


def refresh_autoscaling_coordinator(requester: str, timeout_s: float) -> None:
    """Have Ray's AutoscalingCoordinator (Ray Data's cluster-wide actor, which Ray Train's
    elastic policy asks) look at the nodes now, as ``requester``."""
    import ray

    try:
        from ray.data._internal.cluster_autoscaler.default_autoscaling_coordinator import \
            get_or_create_autoscaling_coordinator
    except ImportError as err:
        raise moved("the AutoscalingCoordinator", err) from None
    coordinator = get_or_create_autoscaling_coordinator()
    ray.get(coordinator.get_reserved_resources.remote(requester, recompute=True), timeout=timeout_s)
