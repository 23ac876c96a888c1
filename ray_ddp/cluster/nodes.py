"""Ray's node table, read for what a failure needs: which nodes Ray has marked dead. Runs
on the driver and in Ray Train's controller (a Ray actor), both attached to Ray."""

from __future__ import annotations


def dead_nodes() -> dict[str, str]:
    """The nodes Ray's GCS holds as dead, each ID with its IP address; empty if the table
    cannot be read (a failure is then told from its error alone). Ray marks a node dead
    before it fails the actors that were on it, so a worker lost with its node finds its
    node here."""
    import ray

    try:
        return {n["NodeID"]: n.get("NodeManagerAddress") or "" for n in ray.nodes() if not n.get("Alive")}
    except Exception:  # noqa: BLE001 (the GCS unreachable: the error's own words decide)
        return {}
