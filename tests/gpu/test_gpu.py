"""GPU-only paths: NCCL, one GPU per worker, toy-mp over a GPU pair, GPU -> CPU checkpoints,
and the devices ``ray_ddp.spawn`` / ``ray-ddp launch`` give their processes."""

import os

import pytest
import torch
import torch.distributed as dist

import ray_ddp
from ray_ddp import TrainConfig, run
from ray_ddp.checkpoint.format import MODEL_FILE
from ray_ddp.checkpoint.verify import weights_hash
from ray_ddp.parallel.ddp import wrap_ddp
from ray_ddp.models.builtin import ToyModel, ToyMpModel

GPUS = torch.cuda.device_count()


@pytest.fixture
def single_process_group():
    # an in-memory store: a fixed TCP port stayed taken after the previous test's group
    # (EADDRINUSE on the first GPU machine these tests ran on)
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize("pair", [(0, 0), (0, 1)])
def test_toy_mp_over_devices_trains_under_ddp(single_process_group, pair):
    if max(pair) >= GPUS:
        pytest.skip(f"needs {max(pair) + 1} GPUs")
    devs = [torch.device(f"cuda:{i}") for i in pair]
    model = ToyMpModel(*devs)
    ddp = wrap_ddp(model, devs)
    before = weights_hash(model)
    out = ddp(torch.randn(8, 10))
    assert out.device == devs[1]
    out.pow(2).mean().backward()
    torch.optim.SGD(ddp.parameters(), lr=0.1).step()
    assert weights_hash(model) != before


def test_bf16_autocast_forward(single_process_group):
    model = wrap_ddp(ToyModel().cuda(), [torch.device("cuda:0")])
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out = model(torch.randn(8, 10, device="cuda"))
    assert out.dtype == torch.bfloat16


@pytest.fixture(scope="module")
def ray_gpu():
    import ray

    ray.init(address="local", include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def test_nccl_run_world_size_1_and_checkpoint_loads_on_cpu(ray_gpu, tmp_path):
    summary = run(TrainConfig(workers=1, gpus_per_worker=1, epochs=2, steps_per_epoch=10,
                              storage=str(tmp_path), name="gpu1", quiet=True))
    assert (summary.backend, summary.gpus_per_worker, summary.epochs_completed) == ("nccl", 1, 2)
    weights = torch.load(f"{summary.checkpoint}/{MODEL_FILE}", weights_only=True)
    assert all(t.device.type == "cpu" for t in weights.values())
    ToyModel().load_state_dict(weights)


def test_toy_mp_run_over_a_gpu_pair(ray_gpu, tmp_path):
    if GPUS < 2:
        pytest.skip("needs 2 GPUs")
    summary = run(TrainConfig(model="toy-mp", workers=1, gpus_per_worker=2, epochs=1,
                              steps_per_epoch=10, storage=str(tmp_path), name="mp", quiet=True))
    assert summary.gpus_per_worker == 2 and summary.epochs_completed == 1


def test_two_workers_share_one_gpu_over_gloo(ray_gpu, tmp_path):
    """Fractional GPUs: two workers on one GPU, gloo between them (no NCCL on a shared GPU)."""
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    from ray_ddp.driver.resolve import resolve
    from ray_ddp.plan import WorkerPlan
    from ray_ddp.storage import resolve_storage
    from ray_ddp.worker.loop import train_loop_per_worker

    cfg = TrainConfig(workers=2, gpus_per_worker=1, backend="gloo", epochs=1, steps_per_epoch=5,
                      report_every=5, storage=str(tmp_path), name="shared")
    trainer = TorchTrainer(
        train_loop_per_worker,
        train_loop_config=WorkerPlan(run=resolve(cfg.validate(), None, store=resolve_storage(cfg.storage)),
                                     resume_from=None, newest_at_start=None,
                                     total_steps=5),
        torch_config=TorchConfig(backend="gloo"),
        scaling_config=ScalingConfig(num_workers=2, use_gpu=True,
                                     resources_per_worker={"CPU": 1, "GPU": 0.5}),
        run_config=RunConfig(name="shared", storage_path=str(tmp_path)),
    )
    result = trainer.fit()
    assert result.checkpoint is not None


def test_compile_and_fp16_on_one_gpu(ray_gpu, tmp_path):
    summary = run(TrainConfig(workers=1, gpus_per_worker=1, amp="fp16", compile=True, epochs=1,
                              steps_per_epoch=20, storage=str(tmp_path), name="compiled", quiet=True))
    state = torch.load(f"{summary.checkpoint}/train_state.pt", weights_only=True)
    # the fp16 scaler was on and stepped: its scale is 2^16 halved per overflow, and it has
    # counted the steps since the last overflow (an off scaler saves an empty state)
    assert state["scaler"]["scale"] in {2.0**k for k in range(17)}
    assert state["scaler"]["_growth_tracker"] >= 1 and summary.final_loss < 1.0


def test_rng_of_the_workers_own_gpu_only(single_process_group):
    from ray_ddp.checkpoint.format import capture_rng, restore_rng

    own = [torch.device("cuda:0")]
    state = capture_rng(own)
    assert len(state["cuda"]) == 1  # not one per visible GPU: a resume may have fewer
    first = torch.randn(4, device="cuda:0")
    restore_rng(state, own)
    assert torch.equal(torch.randn(4, device="cuda:0"), first)


def test_sync_batchnorm_and_a_classifier_on_one_gpu(ray_gpu, tmp_path):
    import sys

    from ray_ddp.data.synth_files import write_synthetic

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "helpers"))
    write_synthetic(str(tmp_path / "cls"), rows=2000, features=10, targets=1, task="classification", classes=5)
    summary = run(TrainConfig(workers=1, gpus_per_worker=1, model="user_models:batchnorm_net",
                              data=str(tmp_path / "cls"), num_classes=5, sync_batchnorm=True,
                              val_fraction=0.2, epochs=2, batch_size=64, storage=str(tmp_path),
                              name="syncbn", quiet=True))
    weights = torch.load(f"{summary.checkpoint}/{MODEL_FILE}", weights_only=True)
    assert "bn1d.running_mean" in weights and summary.val_accuracy is not None


def test_fsdp_bf16_gpt_on_one_gpu_resumes_and_exports(ray_gpu, tmp_path):
    """FSDP2 over NCCL with bf16 parameters and fp32 reductions: a run, a resume from its
    sharded checkpoint, and both model.pt and `ray-ddp export` loading on the CPU."""
    from ray_ddp.export.run import export_model
    from ray_ddp.models.builtin import GPT

    text = tmp_path / "text.txt"  # --task lm trains on text: a few KB of bytes
    text.write_bytes(bytes(range(256)) * 64)
    cfg = dict(model="gpt", strategy="fsdp", amp="bf16", width=64, depth=2, heads=4, seq_len=32,
               task="lm", data=str(text), workers=1, gpus_per_worker=1, optimizer="adamw", lr=1e-3, clip_grad=1.0,
               storage=str(tmp_path), name="fsdp", quiet=True)
    first = run(TrainConfig(epochs=1, **cfg))  # an epoch is one pass over the text's windows
    resumed = run(TrainConfig(epochs=2, **cfg))
    assert first.backend == "nccl" and resumed.resumed_from == first.checkpoint
    model = GPT(256, 64, 2, 4, 32)
    model.load_state_dict(torch.load(f"{resumed.checkpoint}/{MODEL_FILE}", weights_only=True))
    exported = export_model("fsdp", str(tmp_path), step=first.steps, out=str(tmp_path / "first.pt"))
    weights = torch.load(tmp_path / "first.pt", weights_only=True)  # FSDP's checkpoint holds model.pt too
    assert exported.tensors == len(weights) and all(t.device.type == "cpu" for t in weights.values())


def own_device(rank):
    """What a spawned process sees and picks (nothing touched CUDA before this call)."""
    return (os.environ["LOCAL_RANK"], os.environ.get("CUDA_VISIBLE_DEVICES"), str(ray_ddp.device()),
            torch.cuda.is_available(), torch.cuda.device_count())


def test_spawned_gpu_processes_see_the_nodes_gpus_and_pick_cuda_local_rank(ray_gpu):
    n = min(GPUS, 2)
    seen = ray_ddp.spawn(own_device, nprocs=n, gpus_per_process=1)
    assert sorted(local for local, *_ in seen) == [str(k) for k in range(n)]
    for local, visible, dev, _, count in seen:
        assert dev == f"cuda:{local}" and count == n and len(visible.split(",")) == n


def test_a_spawned_cpu_process_on_a_gpu_node_is_on_the_cpu(ray_gpu):
    # Ray leaves a process without GPUs every GPU of the node: CUDA is there, but not its own
    [(_, _, dev, _, _)] = ray_ddp.spawn(own_device, nprocs=1, gpus_per_process=0)
    assert dev == "cpu"


TORCHRUN_SET_DEVICE = """
import os
import torch
import torch.distributed as dist
import ray_ddp

local_rank = int(os.environ["LOCAL_RANK"])
torch.cuda.set_device(local_rank)  # the standard torchrun line, unchanged
dist.init_process_group("nccl")
assert ray_ddp.device() == torch.device("cuda", local_rank), (ray_ddp.device(), local_rank)
total = torch.ones(1, device="cuda") * (dist.get_rank() + 1)
dist.all_reduce(total)
print(f"rank {dist.get_rank()} local {local_rank} of {os.environ['CUDA_VISIBLE_DEVICES']} "
      f"sum {total.item():g}", flush=True)
dist.destroy_process_group()
"""


def test_launch_runs_torchrun_code_that_sets_cuda_local_rank(ray_gpu, tmp_path, capsys):
    from ray_ddp.launch.launch import launch

    if GPUS < 2:
        pytest.skip("needs 2 GPUs")
    script = tmp_path / "set_device.py"
    script.write_text(TORCHRUN_SET_DEVICE)
    code = launch([str(script)], nprocs=2, gpus_per_process=1)
    out, err = capsys.readouterr()
    assert code == 0, err
    # "[rankR]: rank R local L of V sum S", one line per rank: each set its own GPU of both
    said = sorted(line.split()[2:] for line in out.splitlines() if " sum " in line)
    assert [(rank, visible.count(",") + 1, total) for rank, _, _, _, visible, _, total in said] \
        == [("0", 2, "3"), ("1", 2, "3")]
    assert sorted(local for _, _, local, *_ in said) == ["0", "1"]


def test_a_hang_under_nccl_leaves_each_ranks_flight_recorder_in_the_runs_hangs_folder(ray_gpu, tmp_path):
    """The hang watch under NCCL (--hang-timeout 10): the rank asleep in its forward is
    named, and every rank's flight recorder, NCCL's own dump (``_dump_nccl_trace_json``),
    lands in <run>/hangs/<step>/; with 2 GPUs, rank 0's shows the step's all-reduce its
    peer never joined. The run stops (no --max-failures): one line, a TrainingError."""
    import functools
    import json

    from user_models import hangs_on_schedule

    workers = min(2, GPUS)
    hung = workers - 1
    cfg = TrainConfig(workers=workers, gpus_per_worker=1, epochs=1, steps_per_epoch=10, storage=str(tmp_path),
                      name="nccl-hang", hang_timeout=10, wait_timeout=20, snapshot_every_steps=0, quiet=True)
    with pytest.raises(ray_ddp.TrainingError):
        run(cfg, model=functools.partial(hangs_on_schedule, str(tmp_path / "lives"), ((hung, "forward", 3),)))
    [folder] = (tmp_path / "nccl-hang" / "hangs").iterdir()
    for rank in range(workers):
        record = json.loads((folder / f"rank-{rank}.collectives.json").read_text())
        assert record["entries"] and all(e["profiling_name"].startswith("nccl:") for e in record["entries"])
    assert (folder / f"rank-{hung}.txt").read_text().startswith(f"rank {hung}: NOT in a collective")
    if workers == 2:
        assert "not done" in (folder / "rank-0.txt").read_text()
