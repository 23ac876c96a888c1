"""The KubeRay manifests (k8s/) say what an elastic spot run needs, and what they run is a
valid ray-ddp command at the Ray version ray_ddp pins."""

import pathlib
import re
import shlex

import yaml

from ray_ddp.cli.common import config_from_args
from ray_ddp.cli.main import build_parser
from ray_ddp.config.workers import worker_range

ROOT = pathlib.Path(__file__).parents[2]


def pinned_ray() -> str:
    return re.search(r'"ray\[[^\]]*\]==([0-9.]+)"', (ROOT / "pyproject.toml").read_text())[1]


def load(name):
    return yaml.safe_load((ROOT / "k8s" / name).read_text())


def containers(spec):
    return spec["template"]["spec"]["containers"]


def check_cluster(cluster: dict) -> None:
    """What both manifests' clusters must have."""
    assert cluster["rayVersion"] == pinned_ray()
    assert cluster["enableInTreeAutoscaling"] is True
    head = cluster["headGroupSpec"]
    assert head["rayStartParams"]["num-cpus"] == "0", "the head schedules no training"
    groups = cluster["workerGroupSpecs"]
    for spec in [head, *groups]:
        for c in containers(spec):
            assert c["image"].endswith(":" + pinned_ray())
            env = {e["name"]: e for e in c["env"]}
            assert env["RAY_AUTH_MODE"]["value"] == "token" and "secretKeyRef" in env["RAY_AUTH_TOKEN"]["valueFrom"]
    for group in groups:
        pod = group["template"]["spec"]
        (worker,) = pod["containers"]
        assert worker["resources"]["limits"]["nvidia.com/gpu"] == 1
        hook = " ".join(worker["lifecycle"]["preStop"]["exec"]["command"])
        assert "ray drain-node --reason DRAIN_NODE_REASON_PREEMPTION" in hook
        deadline = int(re.search(r"--deadline-remaining-seconds (\d+)", hook)[1])
        sleep = int(re.search(r"sleep (\d+)", hook)[1])
        # the pod outlives the hook's wait, and the run has that long to save a checkpoint
        assert pod["terminationGracePeriodSeconds"] >= sleep + 20 and sleep >= deadline >= 20


def test_the_image_is_rays_at_the_pinned_version():
    assert f"FROM rayproject/ray:{pinned_ray()}-" in (ROOT / "k8s" / "Dockerfile").read_text()


def test_rayjob_runs_a_resumable_elastic_training_that_matches_its_worker_group():
    job = load("rayjob.yaml")
    assert (job["apiVersion"], job["kind"]) == ("ray.io/v1", "RayJob")
    spec = job["spec"]
    assert spec["shutdownAfterJobFinishes"] is True and spec["backoffLimit"] >= 1
    check_cluster(spec["rayClusterSpec"])
    argv = shlex.split(spec["entrypoint"])
    assert argv[:2] == ["ray-ddp", "train"]
    cfg = config_from_args(build_parser().parse_args(argv[1:])).validate()
    # a retried job resumes: a fixed name, on storage every pod (and a new cluster) reaches
    assert cfg.name and cfg.storage.startswith(("s3://", "gs://"))
    (group,) = spec["rayClusterSpec"]["workerGroupSpecs"]
    assert cfg.gpus_per_worker == 1  # one worker per 1-GPU pod
    assert worker_range(cfg.workers) == (group["minReplicas"], group["maxReplicas"])
    assert cfg.global_batch is not None  # what it learns does not depend on the pods it got


def test_raycluster_autoscales_gpu_pods_from_zero():
    cluster = load("raycluster.yaml")
    assert (cluster["apiVersion"], cluster["kind"]) == ("ray.io/v1", "RayCluster")
    check_cluster(cluster["spec"])
    (group,) = cluster["spec"]["workerGroupSpecs"]
    assert group["minReplicas"] == 0 < group["maxReplicas"]
