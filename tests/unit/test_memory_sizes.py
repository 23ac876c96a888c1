"""docs/fsdp.md's memory table is scripts/memory_sizes.py's output, and its formula agrees
with the CPU peaks benchmarks/fsdp_memory.py measured (its result files)."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path


ROOT = Path(__file__).resolve().parents[2]


def sizes():
    spec = importlib.util.spec_from_file_location("memory_sizes", ROOT / "scripts" / "memory_sizes.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_the_docs_table_is_the_scripts_output():
    page = (ROOT / "docs" / "fsdp.md").read_text()
    table = re.search(r"<!-- sizes:start -->\n(.*?)<!-- sizes:end -->", page, re.S).group(1)
    assert table == sizes().render_table(), "run: python scripts/memory_sizes.py, and paste it into docs/fsdp.md"


def test_the_formula_per_rank():
    mod = sizes()
    assert mod.state_per_rank(7e9, "ddp", 8, 8) == 112e9
    assert mod.state_per_rank(7e9, "fsdp", 32, 8) == 7e9 * 16 / 32
    assert mod.state_per_rank(7e9, "hsdp", 32, 8) == 7e9 * 16 / 8  # a node's share, however many nodes
    assert mod.state_per_rank(1e9, "fsdp", 4, 4, "sgd") == 3e9


def measured():
    """benchmarks/fsdp_memory.py's result files that measured the other ranks' peaks."""
    found = []
    for path in sorted((ROOT / "benchmarks" / "results").glob("fsdp_memory-*.json")):
        result = json.loads(path.read_text())["result"]
        if "others_peak_share" in result and not result["setup"].count("GPU"):
            found.append((path.name, result))
    return found


def test_the_formula_holds_for_the_cpu_peaks_measured():
    """What the formula leaves out (the units FSDP gathers, the root's embedding and head
    kept gathered through a step, activations) stays under 0.45 of the model above it;
    the start-up of a rank other than 0 is its share of the model and a tensor."""
    mod = sizes()
    assert measured(), "no fsdp_memory result with the other ranks' peaks"
    for name, r in measured():
        for strategy in ("ddp", "fsdp"):
            if r["others_peak_share"][strategy] is None:  # it ran out of memory there
                continue
            formula = mod.state_per_rank(r["parameters"], strategy, r["workers"], r["workers"], r["optimizer"])
            share = formula / (r["model_mb"] * 2**20)
            gap = r["others_peak_share"][strategy] - share
            assert 0 <= gap < 0.45, (name, strategy, r["others_peak_share"][strategy], share)
        assert r["others_setup_share"]["fsdp"] < 1 / r["workers"] + 0.15, name
