"""Synthetic data is a pure function of its coordinates; metrics summaries add up."""

import pyarrow as pa
import torch

from ray_ddp.data.synth import SyntheticSource, synthetic_rows, teacher_weights
from ray_ddp.data.sources import part_span
from ray_ddp.driver.summary import describe_startup
from ray_ddp.record.schema import SCHEMA, unpack_windows
from ray_ddp.observe.summarize import summarize_metrics
from ray_ddp.plan import BatchPlan


def test_rows_repeat_exactly_and_differ_across_steps_and_epochs():
    t = teacher_weights(0, 10, 5)
    a = synthetic_rows(t, 0, epoch=1, step=3, start=0, count=8)
    assert all(torch.equal(u, v) for u, v in zip(a, synthetic_rows(t, 0, 1, 3, 0, 8)))
    for epoch, step, start in [(1, 3, 8), (1, 4, 0), (2, 3, 0)]:
        assert not torch.equal(a[0], synthetic_rows(t, 0, epoch, step, start, 8)[0])


def test_the_global_batch_is_the_same_rows_however_it_is_split():
    # what an elastic run relies on: 256 rows per step on 1, 2, 3 or 4 workers, each
    # micro-batch at most 64 rows, the accumulation worked out for the world size
    t = teacher_weights(0, 10, 5)
    whole_x, whole_y = synthetic_rows(t, 0, 0, 7, 0, 256)
    for world in (1, 2, 3, 4):
        accum = BatchPlan(256, 64).cut(world).grad_accum
        sources = [SyntheticSource(t, 0, r, world, 256, accum) for r in range(world)]
        parts = [src.micro_batch(0, 7, m) for src in sources for m in range(accum)]
        assert max(len(p[0]) for p in parts) <= 64
        assert {p[2] for p in parts} == {256 / world}  # each rank's share: the loss normalizer
        assert torch.equal(torch.cat([p[0] for p in parts]), whole_x)
        assert torch.equal(torch.cat([p[1] for p in parts]), whole_y)


def test_accumulation_and_parts_for_a_fixed_global_batch():
    assert [BatchPlan(512, 64).cut(w).grad_accum for w in (1, 2, 3, 4, 8, 16)] == [8, 4, 3, 2, 1, 1]
    for total, parts in [(256, 8), (100, 3), (5, 8)]:
        spans = [part_span(total, parts, k) for k in range(parts)]
        assert sum(c for _, c in spans) == total
        assert all(spans[k][0] + spans[k][1] == spans[k + 1][0] for k in range(parts - 1))
        assert [c for _, c in spans] == [len(p) for p in torch.arange(total).tensor_split(parts)]


def test_targets_are_learnable_from_the_teacher():
    t = teacher_weights(0, 10, 5)
    x, y = synthetic_rows(t, 0, 0, 0, 0, 4096)
    residual = (y - x @ t).pow(2).mean()
    assert residual < 1e-3 < y.var()


def test_summary_uses_slowest_rank_and_skips_warmup():
    rows = []
    for step, times in [(10, (5.0, 5.0)), (20, (1.0, 2.0)), (30, (1.0, 2.0))]:
        for rank, t in enumerate(times):
            rows.append(dict(epoch=1, step=step, rank=rank, loss=float(rank + step), samples=100,
                             step_time_s=t, samples_per_s=100 / t, time=0.0, busy_s=t / 2, world_size=2, lr=0.1,
                             node_rank=0, node_id='n', weights_hash=None, loaded_hash=None))
    s = summarize_metrics(pa.Table.from_pylist(rows, schema=SCHEMA))
    assert s["final_loss"] == 30.5
    assert s["samples_per_s"] == 400 / 4.0  # (2 ranks x 100) x 2 reports / (2 s + 2 s)
    assert (s["tokens_per_s"], s["data_wait_s"], s["grad_norm"], s["mfu"]) == (None, None, None, None)  # not recorded


def test_summary_figures_over_the_same_windows_as_samples_per_s():
    rows = []
    for step, times, waits in [(10, (5.0, 5.0), (4.0, 4.0)), (20, (1.0, 2.0), (0.1, 0.5)), (30, (1.0, 2.0), (0.2, 0.3))]:
        for rank, t in enumerate(times):
            rows.append(dict(epoch=1, step=step, rank=rank, loss=1.0, samples=100, step_time_s=t, samples_per_s=100 / t,
                             time=0.0, busy_s=t / 2, world_size=2, lr=0.1, node_rank=0, node_id="n",
                             tokens=6400, data_wait_s=waits[rank], grad_norm=0.5 * step, mfu=0.25 + rank / 10))
    s = summarize_metrics(pa.Table.from_pylist(rows, schema=SCHEMA))
    assert s["tokens_per_s"] == 4 * 6400 / 4.0  # the warm-up window (step 10) left out, as for samples
    assert s["data_wait_s"] == (0.5 + 0.3) / 20 and s["data_wait_share"] == (0.5 + 0.3) / 4.0  # the slowest rank's
    assert s["grad_norm"] == 15.0 and abs(s["mfu"] - 0.3) < 1e-12


def test_batched_reports_unpack_into_every_window_in_order():
    # each rank sends its newest window at the top and the unsent older ones under "earlier"
    def sent(rank):
        rows = [dict(step=s, rank=rank) for s in (10, 20, 30)]
        return {**rows[-1], "earlier": rows[:-1]}

    windows = unpack_windows([sent(0), sent(1)])
    assert [[(r["step"], r["rank"]) for r in w] for w in windows] == \
        [[(10, 0), (10, 1)], [(20, 0), (20, 1)], [(30, 0), (30, 1)]]
    assert all("earlier" not in r for w in windows for r in w)
    assert unpack_windows([dict(step=5, rank=0)]) == [[dict(step=5, rank=0)]]


def test_startup_slices_add_up_to_the_first_step_of_this_runs_rank_0():
    marks = dict(process=100.0, run=102.0, attach=102.5, ray=105.0, fit=105.5)
    rows = [dict(rank=0, started_at=50.0, first_step_at=52.0),   # an older run of this name
            dict(rank=1, started_at=110.0, first_step_at=112.5),
            dict(rank=0, started_at=111.0, first_step_at=113.0),
            dict(rank=0, started_at=None, first_step_at=None)]
    table = pa.Table.from_pylist(rows)
    out = describe_startup(marks, table)
    assert out == {"python": 2.0, "checks": 0.5, "ray": 2.5, "placement": 0.5, "trainer": 5.5,
                   "first_step": 2.0, "total": 13.0}
    assert describe_startup(marks, pa.Table.from_pylist(rows[:1])) is None


def test_only_a_processs_first_run_counts_the_interpreter_start(monkeypatch):
    import time

    from ray_ddp.driver import run as driver

    monkeypatch.setattr(driver, "_RUNS_IN_THIS_PROCESS", 0)
    now = time.time()
    assert driver._process_start_time(now) < now - 0.1  # this process started before the test
    assert driver._process_start_time(now) == now  # a second run: its imports were paid before
