"""The Grafana dashboard of ray_ddp's Ray metrics (ray_ddp/trackers/grafana_dashboard.json),
read as JSON without Ray or Grafana: its panels query exactly the Prometheus series
ray_metrics.py exports (Ray's ``ray_`` prefix, ``_total`` on counters), no more and no less;
every query is filtered by the run picked at the top and goes through the ``datasource``
variable; a ``by (...)`` groups only by the metric's own tags; the grid is 24 columns wide
and no two panels overlap."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from ray_ddp.trackers import ray_metrics
from ray_ddp.trackers.ray_metrics import COUNTERS, RANK_GAUGES, RANK_TAGS, RUN_GAUGES, RUN_TAGS

PATH = Path(ray_metrics.__file__).parent / "grafana_dashboard.json"
METRIC = re.compile(r"ray_ddp_\w+")
SELECTOR = re.compile(r"(ray_ddp_\w+)\s*\{([^}]*)\}")
BY = re.compile(r"\bby\s*\(([^)]*)\)")
DATASOURCE = "${datasource}"


def exported() -> dict[str, tuple[str, ...]]:
    """Each Prometheus series ray_metrics.py exports and its tag keys."""
    tags = {f"ray_{name}": RANK_TAGS for name in RANK_GAUGES}
    tags.update({f"ray_{name}": RUN_TAGS for name in RUN_GAUGES})
    tags.update({f"ray_{name}_total": RUN_TAGS for name in COUNTERS})
    return tags


@pytest.fixture(scope="module")
def dashboard() -> dict:
    return json.loads(PATH.read_text())


def all_panels(dashboard: dict) -> list[dict]:
    """Every panel, those inside rows too."""
    out = []
    for panel in dashboard["panels"]:
        out.append(panel)
        out.extend(panel.get("panels", []))
    return out


def exprs(dashboard: dict) -> list[str]:
    return [t["expr"] for p in all_panels(dashboard) for t in p.get("targets", [])]


def test_the_dashboard_is_the_one_to_import(dashboard):
    assert dashboard["uid"] == "ray-ddp"
    assert dashboard["title"] == "ray_ddp training"
    assert dashboard["schemaVersion"] >= 36
    assert PATH.read_text() == json.dumps(dashboard, indent=2) + "\n"  # 2-space indent, as written


def test_panels_query_exactly_the_exported_series(dashboard):
    used = {name for expr in exprs(dashboard) for name in METRIC.findall(expr)}
    expected = set(exported())
    assert used - expected == set(), "panels query series nobody exports"
    assert expected - used == set(), "exported series without a panel"


def test_every_query_is_filtered_by_the_run(dashboard):
    for expr in exprs(dashboard):
        names = METRIC.findall(expr)
        selectors = SELECTOR.findall(expr)
        assert names and len(selectors) == len(names), expr
        for name, matchers in selectors:
            assert 'run="$run"' in [m.strip() for m in matchers.split(",")], expr


def test_groups_only_by_the_metrics_own_tags(dashboard):
    tags = exported()
    for expr in exprs(dashboard):
        for labels in BY.findall(expr):
            for label in (x.strip() for x in labels.split(",") if x.strip()):
                for name in METRIC.findall(expr):
                    assert label in tags[name], f"{expr}: {name} has no tag {label}"


def test_everything_goes_through_the_datasource_variable(dashboard):
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    source = variables["datasource"]
    assert (source["type"], source["query"]) == ("datasource", "prometheus")
    run = variables["run"]
    assert run["type"] == "query" and run["includeAll"] is False
    assert run["query"] == "label_values(ray_ddp_step, run)"
    assert run["datasource"]["uid"] == DATASOURCE
    assert set(METRIC.findall(run["query"])) <= set(exported())
    for panel in all_panels(dashboard):
        if panel["type"] == "row":
            continue
        assert panel["datasource"]["uid"] == DATASOURCE, panel["title"]
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            assert target.get("datasource", panel["datasource"])["uid"] == DATASOURCE, panel["title"]


def test_the_layout_is_tidy(dashboard):
    panels = all_panels(dashboard)
    assert len({p["id"] for p in panels}) == len(panels)
    for panel in panels:
        refs = [t["refId"] for t in panel.get("targets", [])]
        assert len(set(refs)) == len(refs), panel["title"]
    cells: dict[tuple[int, int], str] = {}
    for panel in panels:
        grid = panel["gridPos"]
        assert grid["x"] >= 0 and grid["w"] > 0 and grid["h"] > 0
        assert grid["x"] + grid["w"] <= 24, panel["title"]
        for x in range(grid["x"], grid["x"] + grid["w"]):
            for y in range(grid["y"], grid["y"] + grid["h"]):
                assert (x, y) not in cells, f"{panel['title']} overlaps {cells.get((x, y))}"
                cells[(x, y)] = panel["title"]
