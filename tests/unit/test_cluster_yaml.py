"""cluster.yaml validates against the installed Ray's cluster-launcher schema and says
what the autoscaled setup needs; the example configs are valid ray-ddp configs."""

import json
import os
import pathlib

import jsonschema
import ray
import yaml

from ray_ddp.config.train import TrainConfig

ROOT = pathlib.Path(__file__).parents[2]


def load_cluster():
    return yaml.safe_load((ROOT / "cluster.yaml").read_text())


def test_cluster_yaml_matches_rays_schema():
    schema_path = os.path.join(os.path.dirname(ray.__file__), "autoscaler", "ray-schema.json")
    with open(schema_path) as f:
        schema = json.load(f)
    jsonschema.validate(load_cluster(), schema)


def test_cluster_yaml_autoscales_gpu_nodes_behind_a_cpu_only_head():
    cfg = load_cluster()
    types = cfg["available_node_types"]
    assert types[cfg["head_node_type"]]["resources"] == {"CPU": 0}
    gpu = [t for t in types.values() if t["resources"].get("GPU") == 8]
    assert all(t["min_workers"] == 0 and t["max_workers"] >= 1 for t in gpu)
    # the same GPU machine on demand and on spot, for elastic runs to use both
    spot = [t for t in gpu if t["node_config"].get("InstanceMarketOptions", {}).get("MarketType") == "spot"]
    on_demand = [t for t in gpu if "InstanceMarketOptions" not in t["node_config"]]
    assert len(spot) == 1 and len(on_demand) == 1
    assert spot[0]["node_config"]["InstanceType"] == on_demand[0]["node_config"]["InstanceType"]
    assert cfg["max_workers"] >= sum(t["max_workers"] for t in gpu)
    assert cfg["idle_timeout_minutes"] > 0
    assert any("pip install" in c and "ray_ddp" in c for c in cfg["setup_commands"])
    assert cfg["file_mounts"]["~/ray_ddp"] == "."


def test_example_configs_are_valid():
    for name in ("toy.yaml", "cloud.yaml"):
        cfg = TrainConfig.from_yaml(str(ROOT / "examples" / name)).validate()
        assert cfg.model in ("toy", "mlp")
    assert TrainConfig.from_yaml(str(ROOT / "examples" / "cloud.yaml")).storage.startswith("s3://")
