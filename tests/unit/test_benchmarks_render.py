"""Benchmark results are data: each benchmark writes a result file (benchmarks/_results.py),
scripts/render_benchmarks.py renders docs/performance.md's tables from them, and the page
stays in sync with the files. No Ray: the benchmarks' mains run with their Ray-backed
arms replaced by fixed figures, which checks what they write, not what they measure."""

from __future__ import annotations

import importlib.util
import json
import pathlib
import re
import shutil
import subprocess
import sys
import types

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
BENCHMARKS = ROOT / "benchmarks"
RESULTS = BENCHMARKS / "results"
PAGE = ROOT / "docs" / "performance.md"
RENDER = ROOT / "scripts" / "render_benchmarks.py"

sys.path.insert(0, str(BENCHMARKS))
import _results  # noqa: E402


def load(path: pathlib.Path, name: str) -> types.ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


render = load(RENDER, "render_benchmarks")


def section(text: str, bench: str) -> str:
    m = re.search(rf"<!-- bench:{bench}:start -->\n(.*?)<!-- bench:{bench}:end -->", text, re.DOTALL)
    assert m, f"no {bench} section"
    return m.group(1)


def render_into(tmp_path: pathlib.Path, results_dir: pathlib.Path, name: str = "performance.md") -> str:
    """Render a copy of the page ``name`` (under docs/) from ``results_dir``; the copy's new text."""
    page = tmp_path / name
    shutil.copy(ROOT / "docs" / name, page)
    assert render.main(["--results", str(results_dir), "--page", str(page)]) == 0
    return page.read_text()


# ---------------------------------------------------------------------------------------
# (a) the page in the repository is what its result files render


def test_performance_page_is_in_sync_with_the_results():
    proc = subprocess.run([sys.executable, str(RENDER), "--check"], capture_output=True, text=True,
                          cwd=ROOT, check=False)
    assert proc.returncode == 0, (
        f"docs/performance.md is stale or a result file is malformed (exit {proc.returncode}): "
        f"run python scripts/render_benchmarks.py\n{proc.stderr}")


def test_every_bench_has_a_section_and_every_section_a_bench():
    text = PAGE.read_text()
    marked = set(re.findall(r"<!-- bench:([a-z0-9_]+):start -->", text))
    assert marked == {b for b, spec in render.BENCHES.items() if spec.page == "performance.md"}
    for bench, spec in render.BENCHES.items():  # the others' sections are on their own pages
        assert f"<!-- bench:{bench}:start -->" in (ROOT / "docs" / spec.page).read_text(), bench


# ---------------------------------------------------------------------------------------
# (b) write_result writes the documented keys, and the renderer picks the file up


def test_write_result_writes_the_documented_keys_and_render_shows_it(tmp_path):
    out = tmp_path / "results"
    result = {"setup": "test", "baseline": "torchrun", "paired_rounds": 2, "arms": [
        {"workers": 2, "arm": "torchrun", "samples_per_s": 100.0, "baseline_samples_per_s": 100.0,
         "x_baseline": 1.0, "paired_ratio": 1.0, "paired_ratio_all": [1.0, 1.0]},
        {"workers": 2, "arm": "ray-ddp", "samples_per_s": 98765.4, "baseline_samples_per_s": 100.0,
         "x_baseline": 987.654, "paired_ratio": 0.4321, "paired_ratio_all": [0.4, 0.5]}]}
    rounds = [{"round": 1, "workers": 2, "arms": {}}, {"round": 2, "workers": 2, "arms": {}}]
    path = pathlib.Path(_results.write_result("throughput", result, rounds, out_dir=str(out),
                                              command=["python", "benchmarks/throughput.py", "--rounds", "2"]))
    record = json.loads(path.read_text())
    assert set(_results.REQUIRED_KEYS) <= set(record)
    assert path.name == f"throughput-{record['machine']}-{record['date']}.json"
    assert re.fullmatch(r"[a-z0-9_]+-\d+cpu(-gpu-[a-z0-9x-]+)?", record["machine"])
    assert record["cores"] >= 1 and re.fullmatch(r"\d{4}-\d{2}-\d{2}", record["date"])
    assert re.fullmatch(r"[0-9a-f]{40}", record["commit"]["sha"]) and isinstance(record["commit"]["dirty"], bool)
    assert record["command"] == ["python", "benchmarks/throughput.py", "--rounds", "2"]
    assert set(record["versions"]) == {"python", "torch", "ray"}
    assert record["result"] == result and record["rounds"] == rounds

    # the same machine and day again: a new file with the next suffix, the first kept
    again = pathlib.Path(_results.write_result("throughput", result, rounds, out_dir=str(out),
                                               command=record["command"]))
    assert again.name == path.name.replace(".json", "-2.json") and path.exists()

    text = render_into(tmp_path, out)
    table = section(text, "throughput")
    rows = [line for line in table.splitlines() if "98765" in line]
    assert len(rows) == 2, table  # both files, the baseline's own row left out
    assert "0.432" in rows[0] and "`--rounds 2`" in rows[0] and f"`{record['commit']['sha'][:7]}`" in rows[0]
    assert "| 2 |" in rows[0]  # the rounds count
    for other in {b for b, spec in render.BENCHES.items() if spec.page == "performance.md"} - {"throughput"}:
        assert "98765" not in section(text, other)
    # the rendered copy is in sync with those files, and the page as shipped is not
    page = tmp_path / "performance.md"
    assert render.main(["--check", "--results", str(out), "--page", str(page)]) == 0
    shutil.copy(PAGE, page)
    assert render.main(["--check", "--results", str(out), "--page", str(page)]) == 1


def test_a_bench_without_results_says_how_to_run_it(tmp_path):
    text = render_into(tmp_path, tmp_path / "none")
    for bench, spec in render.BENCHES.items():
        if spec.page == "performance.md":
            assert section(text, bench) == f"No result recorded yet; run: `{spec.rerun}`\n"


def test_malformed_results_are_refused(tmp_path):
    out = tmp_path / "results"
    out.mkdir()
    (out / "throughput-x-2026-01-01.json").write_text(json.dumps({"bench": "throughput"}))
    page = tmp_path / "performance.md"
    shutil.copy(PAGE, page)
    assert render.main(["--results", str(out), "--page", str(page)]) == 2
    (out / "throughput-x-2026-01-01.json").write_text(json.dumps(
        {**{k: None for k in _results.REQUIRED_KEYS}, "bench": "no_such_bench"}))
    assert render.main(["--results", str(out), "--page", str(page)]) == 2
    assert page.read_text() == PAGE.read_text()


def test_the_shell_benchmarks_totals_go_through_the_command_line(tmp_path):
    totals = tmp_path / "totals.json"
    totals.write_text(json.dumps({"setup": "s", "workers": 1, "window_s": 10, "training_ticks": 1900,
                                  "other_processes": 12, "other_ticks": 90, "available_ticks": 2000}))
    out = tmp_path / "results"
    assert _results.main(["--bench", "ray_cpu", "--result-file", str(totals), "--command",
                          "WORKERS=1 bash benchmarks/ray_cpu.sh", "--results-dir", str(out)]) == 0
    [path] = out.glob("ray_cpu-*.json")
    record = json.loads(path.read_text())
    assert record["command"] == ["WORKERS=1", "bash", "benchmarks/ray_cpu.sh"]
    assert record["result"]["training_ticks"] == 1900 and record["rounds"][0]["round"] == 1
    row = [line for line in section(render_into(tmp_path, out), "ray_cpu").splitlines() if "1900" in line]
    assert row and "`WORKERS=1`" in row[0]


# ---------------------------------------------------------------------------------------
# (c) every result file in the repository parses and has the required keys


def result_files() -> list[pathlib.Path]:
    return sorted(RESULTS.glob("*.json"))


def test_there_are_result_files():
    assert result_files(), "benchmarks/results/ holds no result file"


@pytest.mark.parametrize("path", result_files(), ids=lambda p: p.name)
def test_every_result_file_parses_and_has_the_required_keys(path):
    record = json.loads(path.read_text())
    missing = set(_results.REQUIRED_KEYS) - set(record)
    assert not missing, f"{path.name} lacks {sorted(missing)}"
    assert record["bench"] in render.BENCHES
    assert path.name.startswith(f"{record['bench']}-{record['machine']}-{record['date']}")
    assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", record["date"])
    assert isinstance(record["result"], dict) and isinstance(record["rounds"], list)
    assert isinstance(record["command"], list) and record["command"]
    assert "sha" in record["commit"] and "dirty" in record["commit"]
    if "source" in record:  # transcribed: says where from, and that its rounds are not whole
        assert re.fullmatch(r"README\.md at commit [0-9a-f]{7,40} \(transcribed\)", record["source"])
        assert record["rounds_recorded"] is False


# ---------------------------------------------------------------------------------------
# every top-level benchmark writes its result at its end (the Ray-backed parts stubbed)


def fake_throughput(mod, monkeypatch):
    def run_arm(arm, args, workers):
        return {"arm": arm, "workers": workers, "samples_per_s": 100.0 + len(arm), "first_step_s": 1.0,
                "wall_s": 2.0, "peak_rss_mb": 500.0, "peak_gpu_mb": None, "startup_s": None}
    monkeypatch.setattr(mod, "run_arm", run_arm)
    return lambda out: mod.main(["--workers", "1,2", "--rounds", "2", "--results-dir", out]), 2


def fake_checkpoint_stall(mod, monkeypatch):
    monkeypatch.setattr(mod, "run_arm", lambda name, args: {
        "arm": name, "samples_per_s": 100.0 if name == "no checkpoints" else 95.0, "checkpoints_checked": ["step-1"]})
    return lambda out: argv_main(monkeypatch, mod, ["--rounds", "2", "--results-dir", out]), 2


def fake_data_throughput(mod, monkeypatch):
    monkeypatch.setattr(mod, "subprocess", types.SimpleNamespace(run=lambda *a, **k: None))  # no data synth
    monkeypatch.setattr(mod, "run_arm", lambda name, args, data: {
        "arm": name, "samples_per_s": {"synthetic": 100.0, "parquet": 99.0, "stream": 98.0}[name], "wall_s": 5.0})
    return lambda out: argv_main(monkeypatch, mod, ["--rounds", "3", "--results-dir", out]), 3


def fake_fsdp_memory(mod, monkeypatch):
    def run_arm(strategy, args, folder):
        tiny = args.width == 16
        others = 300.0 if tiny else 1000.0 if strategy == "ddp" else 450.0
        return {"peak_mb": 1000.0 if strategy == "ddp" else 700.0, "samples_per_s": 100.0 if strategy == "ddp" else 30.0,
                "rank0_setup_mb": 900.0, "others_setup_mb": others, "rank0_peak_mb": 1000.0,
                "others_peak_mb": others + 100.0}

    monkeypatch.setattr(mod, "run_arm", run_arm)
    return lambda out: mod.main(["--rounds", "2", "--results-dir", out]), 2


def fake_activation_memory(mod, monkeypatch):
    monkeypatch.setattr(mod, "measure_arm", lambda arm, args: {
        "saved_mb": 40.0 if arm == "off" else 9.0, "recompute_mb": 8.0 if arm == "off" else None,
        "gpu_peak_mb": None, "step_ms": 100.0 if arm == "off" else 128.0})
    return lambda out: mod.main(["--rounds", "2", "--device", "cpu", "--results-dir", out]), 2


def fake_loader(mod, monkeypatch):
    monkeypatch.setattr(mod, "run_arm", lambda arm, args: {
        "arm": arm, "samples_per_s": {"torchrun": 100.0, "ray-ddp": 99.0, "ray-ddp-in-thread": 25.0}[arm],
        "wall_s": 5.0})
    return lambda out: argv_main(monkeypatch, mod, ["--arms", "torchrun,ray-ddp,ray-ddp-in-thread",
                                                    "--rounds", "2", "--results-dir", out]), 2


def fake_zero_grad(mod, monkeypatch):  # no Ray: the real thing, tiny
    return lambda out: argv_main(monkeypatch, mod, ["--width", "16", "--depth", "1", "--steps", "2",
                                                    "--rounds", "2", "--results-dir", out]), 2


def fake_worker_setup(mod, monkeypatch):
    monkeypatch.setattr(mod, "run_arm", lambda arm: 1.0 if arm == "on" else 0.9)
    return lambda out: argv_main(monkeypatch, mod, ["--rounds", "2", "--results-dir", out]), 2


def fake_gpt_tokens(mod, monkeypatch):
    monkeypatch.setattr(mod, "run_arm", lambda arm, args, data: 1000.0 if arm == "torchrun" else 990.0)
    return lambda out: argv_main(monkeypatch, mod, [
        "--workers", "1", "--batch-size", "1", "--warmup", "1", "--steps", "1", "--seq-len", "8",
        "--rounds", "2", "--results-dir", out]), 2


def fake_startup(mod, monkeypatch):
    monkeypatch.setattr(mod, "run_arm", lambda arm, env, by_process=False: {
        "arm": arm, "first_step_s": 20.0 if arm == "ray-train" else 18.0,
        "wall_s": 30.0 if arm == "ray-train" else 26.0,
        "startup_s": {"python": 2.0, "trainer": 12.0} if arm == "ray-ddp" else None})
    return lambda out: argv_main(monkeypatch, mod, ["--rounds", "2", "--results-dir", out]), 2


def fake_default_job(mod, monkeypatch):
    monkeypatch.setattr(mod, "run_arm", lambda arm, env: {"arm": arm, "wall_s": 30.0 if arm == "ray-train" else 27.0})
    return lambda out: argv_main(monkeypatch, mod, ["--rounds", "2", "--results-dir", out]), 2


def fake_suite_time(mod, monkeypatch):
    monkeypatch.setattr(mod, "time_fast_lane", lambda: {"fast_lane_s": 50.0, "fast_lane_summary": "500 passed",
                                                        "fast_lane_exit": 0})
    monkeypatch.setattr(mod, "time_ci", lambda by_process: {
        "ci_run_s": 900.0, "ci_exit": 0, "install_s": 150.0, "suite_s": 750.0, "tests": 600, "failed": 0,
        "skipped": 13, "slowest": [{"test": "tests/x.py::test_y", "s": 60.0}], "failures": [],
        **({"ci_cpu_s": 1500.0, "ray_train_fits": 47,
            "cpu_by_process": [{"process": "Ray Train workers", "processes": 113, "cpu_s": 560.0}]}
           if by_process else {})})
    return lambda out: argv_main(monkeypatch, mod, ["--by-process", "--results-dir", out]), 1


def fake_flakes(mod, monkeypatch):
    monkeypatch.setattr(mod, "run_round", lambda number, selection: {
        "round": number, "wall_s": 500.0, "exit": 0, "summary": "100 passed", "tests": 100, "failed": 0,
        "skipped": 0, "failures": []})
    return lambda out: argv_main(monkeypatch, mod, ["--rounds", "2", "--results-dir", out]), 2


def fake_install_time(mod, monkeypatch):
    monkeypatch.setattr(mod, "run_arm", lambda arm: {"arm": arm, "install_s": 60.0 if arm == "script" else 80.0,
                                                     "first_import_s": 3.5})
    return lambda out: argv_main(monkeypatch, mod, ["--rounds", "2", "--results-dir", out]), 2


def fake_preemption(mod, monkeypatch):
    monkeypatch.setattr(mod, "run_per_step", lambda args: {
        arm: [{"s_per_step": 0.003 * (1 + i), "calls": 5 * i} for _ in range(args.rounds)]
        for i, arm in enumerate(mod.ARMS)})
    monkeypatch.setattr(mod, "run_notice", lambda args: [2.0] * args.rounds)
    return lambda out: argv_main(monkeypatch, mod, ["--rounds", "2", "--results-dir", out]), 2


def fake_recovery(mod, monkeypatch):
    monkeypatch.setattr(mod, "start_ray", lambda: lambda: None)
    monkeypatch.setattr(mod, "run_arm", lambda arm, job: {
        "arm": arm, "steps_at_kill": 44, "resumed_from_step": 30 if arm == "ray-train" else 40,
        "steps_redone": 14 if arm == "ray-train" else 4, "restart_s": 8.0 if arm == "ray-train" else 7.0,
        "mb_read": 17.0 if arm == "ray-train" else 34.0, "all_mb_read": 17.5 if arm == "ray-train" else 34.5,
        "files_read": {"x/checkpoint.pt": 2}, "wall_s": 60.0})
    return lambda out: argv_main(monkeypatch, mod, ["--rounds", "2", "--results-dir", out]), 2


def fake_snapshot_cost(mod, monkeypatch):
    monkeypatch.setattr(mod, "start_ray", lambda: lambda: None)
    rates = {"off": 2000.0, "default": 1980.0, "every-step": 900.0}
    monkeypatch.setattr(mod, "run_arm", lambda arm, args: {"arm": arm, "samples_per_s": rates[arm]})
    return lambda out: argv_main(monkeypatch, mod, ["--rounds", "2", "--results-dir", out]), 2


def fake_ray_idle_cpu(mod, monkeypatch):
    monkeypatch.setattr(mod, "measure", lambda: ([(9, "raylet ", "main")], 30, 10))
    return lambda out: mod.main(["--results-dir", out]), 1


def argv_main(monkeypatch, mod, argv):
    monkeypatch.setattr(sys, "argv", [f"benchmarks/{mod.__name__.removeprefix('bench_')}.py", *argv])
    return mod.main()


FAKES = {name.removeprefix("fake_"): fn for name, fn in dict(globals()).items() if name.startswith("fake_")}


def test_every_python_benchmark_is_covered():
    """Each top-level benchmark script writes a result and is exercised here; the helpers
    (the baselines' per-rank workloads) are not benchmarks of their own."""
    helpers = {"workload", "plain_ray_train", "gpt_workload", "loader_workload", "slow_reads", "_results", "_procs"}
    scripts = {p.stem for p in BENCHMARKS.glob("*.py")} - helpers
    assert scripts == set(FAKES)
    assert set(render.BENCHES) == scripts | {"ray_cpu"}
    for helper in helpers - {"_results", "_procs"}:
        assert "save_result" not in (BENCHMARKS / f"{helper}.py").read_text()


@pytest.mark.parametrize("bench", sorted(FAKES))
def test_a_benchmark_writes_its_result(bench, tmp_path, monkeypatch, capsys):
    mod = load(BENCHMARKS / f"{bench}.py", f"bench_{bench}")
    run, rounds = FAKES[bench](mod, monkeypatch)
    out = tmp_path / "results"
    run(str(out))
    printed = capsys.readouterr()
    [path] = out.glob("*.json")
    record = json.loads(path.read_text())
    assert record["bench"] == bench and path.name.startswith(f"{bench}-")
    assert set(_results.REQUIRED_KEYS) <= set(record)
    assert record["command"][:2] == ["python", f"benchmarks/{bench}.py"] or bench == "ray_idle_cpu"
    assert len({r["round"] for r in record["rounds"]}) == rounds
    assert "|" in printed.out or "total" in printed.out  # it still prints its table
    assert "result written to" in printed.err
    rendered = section(render_into(tmp_path, out, render.BENCHES[bench].page), bench)
    assert "No result recorded yet" not in rendered and rendered.count("\n| ") >= 1


def test_recovery_rounds_below_one_is_one_line_and_runs_nothing(tmp_path, monkeypatch, capsys):
    mod = load(BENCHMARKS / "recovery.py", "bench_recovery")
    monkeypatch.setattr(mod, "start_ray", lambda: pytest.fail("Ray started"))
    with pytest.raises(SystemExit) as stopped:
        mod.main(["--rounds", "0", "--results-dir", str(tmp_path / "results")])
    assert stopped.value.code == 2
    assert capsys.readouterr().err.strip().splitlines() == ["--rounds 0: give 1 or more"]
    assert not (tmp_path / "results").exists()


def test_recovery_figures_from_its_logs(tmp_path):
    """Steps redone and seconds to the first step come from rank 0's per-process step
    logs and the kill marker; the bytes from checkpoint files read in that window only."""
    mod = load(BENCHMARKS / "recovery.py", "bench_recovery")
    control = tmp_path / "control"
    control.mkdir()
    (control / "killed").write_text("100.0\n")
    (control / "steps-1.log").write_text("".join(f"{50 + i}\n" for i in range(44)))  # the first life
    (control / "steps-2.log").write_text("".join(f"{107 + i}\n" for i in range(20)))  # resumed at 40
    reads = types.SimpleNamespace(reads=[(99.0, "r/step-00000035/model.pt", 5), (103.0, "r/step-00000040/model.pt", 7),
                                         (104.0, "r/progress.json", 1), (108.0, "r/step-00000040/model.pt", 9)])
    reads.between = lambda start, end: [(p, n) for t, p, n in reads.reads if start <= t <= end]
    got = mod.figures({"epochs": 2, "steps_per_epoch": 30}, str(control), reads)
    assert (got["steps_at_kill"], got["resumed_from_step"], got["steps_redone"]) == (44, 40, 4)
    assert got["restart_s"] == 7.0
    assert (got["mb_read"], got["all_mb_read"]) == (7e-6, 8e-6)
    assert got["files_read"] == {"r/step-00000040/model.pt": 1, "r/progress.json": 1}


def test_an_arm_that_runs_out_of_memory_is_said_not_a_failure(tmp_path, monkeypatch, capsys):
    """DDP's 4 whole copies of a model may not fit a host where FSDP's shards do: the
    result says so, with FSDP's figures, and no ratio."""
    mod = load(BENCHMARKS / "fsdp_memory.py", "bench_fsdp_memory")
    fake_fsdp_memory(mod, monkeypatch)
    fits = mod.run_arm
    monkeypatch.setattr(mod, "run_arm", lambda s, a, f: {"out_of_memory": True} if s == "ddp" else fits(s, a, f))
    mod.main(["--rounds", "1", "--results-dir", str(tmp_path)])
    [path] = tmp_path.glob("fsdp_memory-*.json")
    result = json.loads(path.read_text())["result"]
    assert result["out_of_memory"] == "ddp" and result["peak_mb"] == {"ddp": None, "fsdp": 700.0}
    assert result["peak_ratio"] is None and result["others_peak_share"]["ddp"] is None
    assert "| ddp | out of memory |" in capsys.readouterr().out


def test_no_save_writes_nothing(tmp_path, monkeypatch):
    mod = load(BENCHMARKS / "fsdp_memory.py", "bench_fsdp_memory")
    fake_fsdp_memory(mod, monkeypatch)
    mod.main(["--rounds", "1", "--no-save", "--results-dir", str(tmp_path / "results")])
    assert not (tmp_path / "results").exists()
