"""`ray-ddp doctor`'s judgement without Ray: which nodes it names from what was measured
(30 % below its peers' median, a GPU short, late to the group's all-reduce), every pair of
nodes measured once in rounds that share no node, and the table a person reads. The
measuring itself runs on real Ray: tests/integration/test_multinode.py (a slowed node
named) and test_cli.py (a healthy local cluster)."""

from __future__ import annotations

import itertools

from ray_ddp.cli.doctor import format_report
from ray_ddp.cluster.doctor import DoctorReport, NodeHealth, judge, pair_rounds


def healthy(node_id: str, **kw) -> NodeHealth:
    base = dict(host=f"host-{node_id}", cpus=16, gpus=8, gpu_names=["NVIDIA H100 80GB HBM3"] * 8,
                matmul_tflops=[700.0] * 8, storage={"write_mb_s": 900.0, "read_mb_s": 1800.0}, late_s=0.001)
    return NodeHealth(node_id * 8, **{**base, **kw})


def report_of(*nodes: NodeHealth, pairs=()) -> DoctorReport:
    report = DoctorReport("needs 32 workers x 1 GPU = 32 GPU", "nccl", 32, list(nodes), group_busbw_gb_s=180.0,
                          group_step_s=0.02, pairs=list(pairs))
    judge(report)
    return report


def test_healthy_nodes_are_not_named_and_the_run_can_start():
    report = report_of(*(healthy(c) for c in "abcd"))
    assert report.ok and all(not n.problems for n in report.nodes)
    assert format_report(report).splitlines()[-1] == "verdict: the run can start"


def test_a_slow_gpu_a_slow_storage_and_a_missing_gpu_are_each_named():
    slow_gpu = healthy("b", matmul_tflops=[700.0] * 7 + [450.0])  # 36 % below: named
    fine_gpu = healthy("c", matmul_tflops=[700.0] * 7 + [520.0])  # 26 % below: not
    slow_disk = healthy("d", storage={"write_mb_s": 500.0, "read_mb_s": 1800.0})
    short = healthy("e", gpu_names=["NVIDIA H100 80GB HBM3"] * 7)  # Ray counts 8, torch sees 7
    report = report_of(healthy("a"), slow_gpu, fine_gpu, slow_disk, short)
    named = {n.node_id[0]: n.problems for n in report.nodes if n.problems}
    assert set(named) == {"b", "d", "e"} and not report.ok
    assert "GPU 7 reaches 450 TFLOP/s" in named["b"][0]
    assert "writes the run storage at 500 MB/s" in named["d"][0]
    assert named["e"] == ["Ray counts 8 GPUs, torch sees 7"]
    assert "problem: node eeeeeeee… (host-e): Ray counts 8 GPUs, torch sees 7" in format_report(report)


def test_a_node_late_to_every_all_reduce_is_named_by_how_much_it_slows_the_group():
    report = report_of(healthy("a"), healthy("b", late_s=0.3), healthy("c", late_s=0.004))
    assert [n.node_id[0] for n in report.nodes if n.problems] == ["b"]
    assert "come 0.3 s late to each all-reduce" in report.nodes[1].problems[0]


def test_a_slow_link_is_told_by_its_pairs_and_two_nodes_never_blame_one():
    a, b, c, d = (c * 8 for c in "abcd")
    fast, slow = 40.0, 10.0
    pairs = [{"a": x, "b": y, "busbw_gb_s": slow if "d" in (x[0], y[0]) else fast}
             for x, y in itertools.combinations([a, b, c, d], 2)]
    report = report_of(*(healthy(n) for n in "abcd"), pairs=pairs)
    assert [n.node_id[0] for n in report.nodes if n.problems] == ["d"]
    two = report_of(healthy("a"), healthy("b"), pairs=[{"a": a, "b": b, "busbw_gb_s": slow}])
    assert two.ok  # one link cannot say which end is slow


def test_every_pair_is_measured_once_in_rounds_that_share_no_node():
    for count in (1, 2, 3, 4, 7, 8):
        nodes = [f"n{i}" for i in range(count)]
        rounds = pair_rounds(nodes)
        seen = [frozenset(p) for r in rounds for p in r]
        assert sorted(map(sorted, seen)) == sorted(map(sorted, map(frozenset, itertools.combinations(nodes, 2))))
        assert all(len({n for p in r for n in p}) == 2 * len(r) for r in rounds)  # no node twice in a round
        assert len(rounds) <= max(count - 1 + count % 2, 0)
