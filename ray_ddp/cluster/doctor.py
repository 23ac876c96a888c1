"""`ray-ddp doctor`: whether a run should start on this cluster. On the nodes it would
use: their CPUs, GPUs and GPU names against what the run needs; a matmul's TFLOP/s per
device; the run storage's write and read speed from every node; an all-reduce across
ranks placed as the run's would be, with how late each comes to it; an all-reduce
between each pair of nodes; the settings NCCL reads. A node more than 30 % below the
median of its peers, or short of a GPU, is named. Runs on the driver; the measuring is
worker/probes.py's, in actors on the nodes.
"""

from __future__ import annotations

import dataclasses
import statistics
from dataclasses import dataclass, field
from typing import Any, Optional

from ray_ddp.cluster.placement import Placement, plan_placement
from ray_ddp.cluster.preflight import count_slots, describe_have, describe_need
from ray_ddp.worker.probes import Probe

SLOWER = 0.7  # a node below 70 % of its peers' median is named (more than 30 % below)
ANSWER_S = 180.0  # the longest the doctor waits for a node's answer
# how big each measurement is: (all-reduce MB, its rounds, matmul size, storage MB)
SIZES = {"gloo": (8, 5, 512, 16), "nccl": (256, 10, 8192, 256)}


@dataclass
class NodeHealth:
    """One node, as measured; ``problems``: why it is named (none: healthy)."""

    node_id: str
    host: Optional[str] = None
    cpus: float = 0
    gpus: float = 0  # as Ray counts them
    gpu_names: list[str] = field(default_factory=list)  # as torch sees them
    matmul_tflops: list[float] = field(default_factory=list)  # per GPU (one figure: the CPU)
    storage: Optional[dict[str, float]] = None  # write_mb_s, read_mb_s
    late_s: Optional[float] = None  # its ranks' latest coming to the group's all-reduce
    pair_busbw_gb_s: Optional[float] = None  # median over its pairs
    env: dict[str, str] = field(default_factory=dict)
    ib_devices: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)


@dataclass
class DoctorReport:
    """What the doctor found; ``ok`` says whether the run should start."""

    need: str
    backend: str
    workers: int
    nodes: list[NodeHealth]
    group_busbw_gb_s: Optional[float] = None
    group_step_s: Optional[float] = None
    pairs: list[dict[str, Any]] = field(default_factory=list)  # {a, b, busbw_gb_s}
    problems: list[str] = field(default_factory=list)  # the cluster's own (not one node's)

    @property
    def ok(self) -> bool:
        return not self.problems and not any(n.problems for n in self.nodes)

    def to_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "ok": self.ok}


def examine_cluster(workers: Optional[int], gpus_per_worker: Optional[int], storage: Optional[str]) -> DoctorReport:
    """Measure the attached cluster for a run of ``workers`` x ``gpus_per_worker`` GPUs
    (defaults as `ray-ddp train` takes them), its storage at ``storage``."""
    import ray

    alive = [n for n in ray.nodes() if n.get("Alive") and n["Resources"].get("CPU", 0) + n["Resources"].get("GPU", 0)]
    placement = plan_placement(workers, gpus_per_worker, None, [int(n["Resources"].get("GPU", 0)) for n in alive])
    report = DoctorReport(describe_need(placement), placement.backend, placement.workers,
                          [NodeHealth(n["NodeID"], cpus=n["Resources"].get("CPU", 0),
                                      gpus=n["Resources"].get("GPU", 0)) for n in alive])
    if count_slots([n["Resources"] for n in alive], placement) < placement.workers:
        report.problems.append(f"the run {report.need}; {describe_have([n['Resources'] for n in alive], placement)}")
    mb, rounds, matmul_n, storage_mb = SIZES[placement.backend]
    probes = _node_probes(report.nodes)
    _measure_nodes(report, probes, storage, storage_mb, matmul_n)
    _measure_pairs(report, probes, placement.backend, mb, rounds)
    for probe in probes.values():
        ray.kill(probe)
    if not report.problems:
        _measure_group(report, placement, mb, rounds)
    judge(report)
    return report


def _node_probes(nodes: list[NodeHealth]) -> dict[str, Any]:
    """A probe actor pinned to each node, holding the node's GPUs (to see and time them)."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    actor = ray.remote(Probe)
    return {n.node_id: actor.options(num_cpus=0, num_gpus=n.gpus, scheduling_strategy=NodeAffinitySchedulingStrategy(
        n.node_id, soft=False)).remote() for n in nodes}


def _answers(calls: dict[str, Any]) -> dict[str, Any]:
    """Each call's answer, or the exception it ended in (a node that did not answer in
    ANSWER_S seconds: a TimeoutError), by key."""
    import ray

    answers: dict[str, Any] = {}
    ready, _ = ray.wait(list(calls.values()), num_returns=len(calls), timeout=ANSWER_S)
    for key, ref in calls.items():
        if ref not in ready:
            answers[key] = TimeoutError(f"no answer in {ANSWER_S:g} s")
            continue
        try:
            answers[key] = ray.get(ref)
        except Exception as e:  # the node's probe failed: that is the finding
            answers[key] = e
    return answers


def _one_line(e: BaseException) -> str:
    """An error's last line (Ray's carry the remote traceback before it), on one line."""
    lines = [line for line in str(e).splitlines() if line.strip()]
    return " ".join(lines[-1].split())[:200] if lines else type(e).__name__


def _measure_nodes(report: DoctorReport, probes: dict[str, Any], storage: Optional[str], storage_mb: int,
                   matmul_n: int) -> None:
    answers = _answers({node_id: probe.measure_node.remote(storage, storage_mb, matmul_n)
                        for node_id, probe in probes.items()})
    for node in report.nodes:
        found = answers[node.node_id]
        if isinstance(found, Exception):
            node.problems.append(f"its probe failed: {_one_line(found)}")
            continue
        node.host, node.gpu_names, node.matmul_tflops = found["host"], found["gpu_names"], found["matmul_tflops"]
        node.storage, node.env, node.ib_devices = found["storage"], found["env"], found["ib_devices"]
        if found["storage_error"]:
            node.problems.append(f"cannot write and read the run storage: {found['storage_error']}")


def pair_rounds(nodes: list[str]) -> list[list[tuple[str, str]]]:
    """Every pair of nodes once, in rounds of pairs that share no node (the circle method:
    n-1 rounds for n nodes), so each round's pairs measure at once without sharing a link."""
    ring = list(nodes) + ([None] if len(nodes) % 2 else [])
    rounds = []
    for _ in range(len(ring) - 1):
        half = len(ring) // 2
        pairs = [(ring[i], ring[-1 - i]) for i in range(half)]
        rounds.append([(a, b) for a, b in pairs if a is not None and b is not None])
        ring = [ring[0], ring[-1], *ring[1:-1]]
    return [r for r in rounds if r]


def _measure_pairs(report: DoctorReport, probes: dict[str, Any], backend: str, mb: int, rounds: int) -> None:
    """An all-reduce between the two nodes of each pair (one rank on each)."""
    usable = [n.node_id for n in report.nodes if not n.problems]
    for pairs in pair_rounds(usable):
        masters = _answers({pair: probes[pair[0]].address.remote() for pair in pairs})
        calls = {(pair, rank): probes[node].all_reduce.remote(rank, 2, masters[pair], backend, mb, rounds, ANSWER_S)
                 for pair in pairs if not isinstance(masters[pair], Exception) for rank, node in enumerate(pair)}
        answers = _answers(calls) if calls else {}
        for a, b in pairs:
            lost = masters[a, b]  # no address from its first node: nothing was measured
            found = [lost, lost] if isinstance(lost, Exception) else [answers[(a, b), 0], answers[(a, b), 1]]
            failed = next((f for f in found if isinstance(f, Exception)), None)
            busbw = None if failed else max(f["busbw_gb_s"] for f in found)
            report.pairs.append({"a": a, "b": b, "busbw_gb_s": busbw,
                                 **({"error": _one_line(failed)} if failed else {})})


def _measure_group(report: DoctorReport, placement: Placement, mb: int, rounds: int) -> None:
    """An all-reduce over ``placement.workers`` ranks placed as Ray Train places a run's
    (one bundle each, packed), and how late each rank comes to it."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    bundle = placement.resources_per_worker()
    group = placement_group([bundle] * placement.workers, strategy="PACK")
    try:
        if not group.wait(timeout_seconds=ANSWER_S):
            report.problems.append(f"could not place {placement.workers} ranks of {bundle} in {ANSWER_S:g} s")
            return
        actor = ray.remote(Probe)
        ranks = [actor.options(num_cpus=bundle["CPU"], num_gpus=bundle.get("GPU", 0),
                               scheduling_strategy=PlacementGroupSchedulingStrategy(group, i)).remote()
                 for i in range(placement.workers)]
        master = _answers({0: ranks[0].address.remote()})[0]
        answers = {0: master} if isinstance(master, Exception) else _answers(
            {rank: r.all_reduce.remote(rank, len(ranks), master, placement.backend, mb, rounds, ANSWER_S)
             for rank, r in enumerate(ranks)})
        for r in ranks:
            ray.kill(r)
    finally:
        remove_placement_group(group)
    failed = [(rank, a) for rank, a in answers.items() if isinstance(a, Exception)]
    if failed:
        report.problems.append(f"the all-reduce over {len(answers)} ranks failed on rank {failed[0][0]}: "
                               f"{_one_line(failed[0][1])}")
        return
    found = list(answers.values())
    report.group_busbw_gb_s = max(f["busbw_gb_s"] for f in found)  # the rank everyone waited for: the link's
    report.group_step_s = statistics.median(f["late_s"] + f["all_reduce_s"] for f in found)
    for node in report.nodes:
        late = [f["late_s"] for f in found if f["node_id"] == node.node_id]
        node.late_s = max(late) if late else None


def judge(report: DoctorReport) -> None:
    """Name each node short of a GPU, more than 30 % below the median of its peers (a
    device's matmul, the storage's speed, its links), or late enough to its group's
    all-reduce to slow the group's step by more than 30 %."""
    nodes = [n for n in report.nodes if not n.problems]
    most_gpus = max((n.gpus for n in report.nodes), default=0)
    for n in nodes:
        if len(n.gpu_names) < n.gpus:
            n.problems.append(f"Ray counts {n.gpus:g} GPUs, torch sees {len(n.gpu_names)}")
        elif n.gpus < most_gpus:
            n.problems.append(f"has {n.gpus:g} GPUs where its peers have {most_gpus:g}")
    devices = [t for n in nodes for t in n.matmul_tflops]
    if len(devices) > 1:
        median = statistics.median(devices)
        for n in nodes:
            for i, t in enumerate(n.matmul_tflops):
                if t < SLOWER * median:
                    what = f"GPU {i}" if n.gpu_names else "its CPU"
                    n.problems.append(f"{what} reaches {t:.3g} TFLOP/s in a matmul, below 70 % of the "
                                      f"median {median:.3g}")
    for key, what in (("write_mb_s", "writes"), ("read_mb_s", "reads")):
        speeds = [n.storage[key] for n in nodes if n.storage]
        if len(speeds) > 1:
            median = statistics.median(speeds)
            for n in nodes:
                if n.storage and n.storage[key] < SLOWER * median:
                    n.problems.append(f"{what} the run storage at {n.storage[key]:.0f} MB/s, below 70 % of the "
                                      f"median {median:.0f}")
    _judge_links(report, nodes)
    if report.group_step_s:
        lates = [n.late_s for n in nodes if n.late_s is not None]
        usual = statistics.median(lates) if lates else 0.0
        for n in nodes:
            if n.late_s is not None and n.late_s - usual > (1 - SLOWER) * report.group_step_s:
                n.problems.append(f"its ranks come {n.late_s:.3g} s late to each all-reduce, where the "
                                  f"group's step takes {report.group_step_s:.3g} s: every rank waits for it")


def _judge_links(report: DoctorReport, nodes: list[NodeHealth]) -> None:
    by_node: dict[str, list[float]] = {}
    for pair in report.pairs:
        for node in (pair["a"], pair["b"]):
            by_node.setdefault(node, []).append(pair["busbw_gb_s"] or 0.0)
    for n in nodes:
        if n.node_id in by_node:
            n.pair_busbw_gb_s = statistics.median(by_node[n.node_id])
    failed = {p[k] for p in report.pairs if p.get("error") for k in ("a", "b")}
    scores = [n.pair_busbw_gb_s for n in nodes if n.pair_busbw_gb_s is not None]
    # with two nodes there is one link: it cannot say which end is slow
    median = statistics.median(scores) if len(scores) > 2 else None
    for n in nodes:
        if n.node_id in failed and all(p.get("error") for p in report.pairs if n.node_id in (p["a"], p["b"])):
            n.problems.append("its all-reduce with every other node failed")
        elif median and n.pair_busbw_gb_s is not None and n.pair_busbw_gb_s < SLOWER * median:
            n.problems.append(f"its links reach {n.pair_busbw_gb_s:.3g} GB/s of bus bandwidth, below 70 % of "
                              f"the median {median:.3g}")
