"""ray_ddp's step in plain gloo process groups, no Ray: what tests/integration/
test_loss_matrix.py runs on each rank. ``run_on_ranks`` starts the ranks (processes on
loopback, forked from a server that has imported torch: rank_procs.py; this folder on
their path) and returns what each rank's function returned; ``one_step`` is such a
function: for each case (a tiny HF model, DDP or FSDP) it takes one optimizer step of
ray_ddp's train_step (worker/step.py) on this rank's share of a global batch, cut into
micro-batches, and returns the whole weights after it;
``two_steps_of_a_forward_that_skips_a_layer`` says what a DDP step makes of such a model."""

from __future__ import annotations

import io
import os
import socket
import sys

from typing import Optional

import torch

from rank_procs import rank_context, start_rank

HERE = os.path.dirname(os.path.abspath(__file__))


def run_on_ranks(world: int, fn, *args, timeout_s: float = 300.0) -> list:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = rank_context()
    results = ctx.Queue()
    procs = [start_rank(ctx, _rank_main, rank, world, port, fn, args, results) for rank in range(world)]
    try:
        out = dict(results.get(timeout=timeout_s) for _ in procs)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    errors = {rank: r for rank, r in out.items() if isinstance(r, str)}
    assert not errors, errors
    return [torch.load(io.BytesIO(out[rank]), weights_only=False) for rank in range(world)]


def _rank_main(rank, world, port, fn, args, results):
    import traceback

    import torch.distributed as dist

    sys.path.insert(0, HERE)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        # as bytes: a tensor put on a queue is shared memory the parent reads after this exits
        buffer = io.BytesIO()
        torch.save(fn(rank, world, *args), buffer)
        results.put((rank, buffer.getvalue()))
    except BaseException:
        results.put((rank, "error: " + traceback.format_exc()))
    finally:
        dist.destroy_process_group()


def one_step(rank: int, world: int, cases: list, global_rows: int, micro_batches: int,
             empty_first: bool = False) -> dict:
    """{(kind, strategy): the whole weights after one SGD step (lr 1: the step is the
    gradient)} for this rank's rows [rank * n, (rank + 1) * n) of the global batch, n =
    global_rows / world, in ``micro_batches`` equal parts; ``empty_first``: a micro-batch
    with no rows before them (a fresh rank that has trained on no row yet)."""
    from ray_ddp.config.train import TrainConfig
    from ray_ddp.tasks.build import build_task
    from ray_ddp.worker.step import train_step
    from ray_ddp.worker.window import WindowState

    from hf_tiny import BUILTIN, rows, task_of, tiny

    cpu = torch.device("cpu")
    out = {}
    for kind, strategy_name in cases:
        model = tiny(kind)
        # hsdp: shard groups of 2 ranks, replicas of each other
        parts = _parts(model, TrainConfig(strategy=strategy_name,
                                          fsdp_shard_size=2 if strategy_name == "hsdp" else None))
        x = rows(kind, global_rows)
        count = len(x["labels"])  # ray_ddp's own tasks: one row short, so the cut is uneven
        cut = torch.tensor_split(torch.arange(count), world * micro_batches)
        parts_of = [{k: v[idx] for k, v in x.items()} for idx in cut[rank * micro_batches:(rank + 1) * micro_batches]]
        builtin = kind in BUILTIN
        # as rows_of_step: the share is the step's rows over the ranks
        if empty_first:
            parts_of = [{k: v[:0] for k, v in parts_of[0].items()}, *parts_of]
        source = _Batches([(p["inputs"] if builtin else p, p["labels"], count / world) for p in parts_of])
        task = build_task(task_of(kind), 8, model=model, model_loss=not builtin)
        train_step(parts, task, source, WindowState.start(cpu, cpu), 0, 0, len(parts_of), 0.0, cpu)
        out[(kind, strategy_name)] = {n: _whole(p) for n, p in model.named_parameters()}
    return out


def a_step_without_units(rank: int, world: int, strategy_name: str) -> tuple[dict, dict]:
    """A tiny GPT-2 under AdamW (weight decay 0.1): one step on real rows, then a step
    whose every label is -100 on every rank; the whole weights after each."""
    from ray_ddp.config.train import TrainConfig
    from ray_ddp.tasks.build import build_task
    from ray_ddp.worker.step import train_step
    from ray_ddp.worker.window import WindowState

    from hf_tiny import rows, tiny

    cpu = torch.device("cpu")
    model = tiny("gpt2")
    parts = _parts(model, TrainConfig(strategy=strategy_name))
    parts.optimizer = torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.1)
    real = {k: v[rank * 2:(rank + 1) * 2] for k, v in rows("gpt2", 8).items()}
    masked = {**real, "labels": torch.full_like(real["labels"], -100)}
    source = _Batches(None, steps=[[(real, real["labels"], 2.0)], [(masked, masked["labels"], 2.0)]])
    task = build_task("lm", 8, model=model, model_loss=True)
    after = []
    for step in range(2):
        train_step(parts, task, source, WindowState.start(cpu, cpu), 0, step, 1, 0.0, cpu)
        after.append({n: _whole(p) for n, p in model.named_parameters()})
    return after[0], after[1]


def two_steps_of_a_forward_that_skips_a_layer(rank: int, world: int) -> tuple[str, str]:
    """ray_ddp's train_step, twice, under DDP, on a model whose forward never uses one of
    its layers (user_models.UnusedBranch), without --find-unused-parameters and with it:
    for each, "trained" or the one line the worker loop raises instead of DDP's error."""
    return tuple(_two_steps_of_unused_branch(rank, flag) for flag in (False, True))


def _two_steps_of_unused_branch(rank: int, find_unused_parameters: bool) -> str:
    from ray_ddp.config.train import TrainConfig
    from ray_ddp.tasks.build import build_task
    from ray_ddp.worker.step import train_step, unused_parameters_error
    from ray_ddp.worker.window import WindowState

    from user_models import UnusedBranch

    cpu = torch.device("cpu")
    model = UnusedBranch()
    parts = _parts(model, TrainConfig(find_unused_parameters=find_unused_parameters))
    g = torch.Generator().manual_seed(rank)
    source = _Batches([(torch.randn(4, 10, generator=g), torch.randn(4, 5, generator=g), 4.0)])
    task = build_task("regression", 8)
    try:
        for step in range(2):  # DDP tells of the skipped layer at the next step's forward
            train_step(parts, task, source, WindowState.start(cpu, cpu), 0, step, 1, 0.0, cpu)
    except RuntimeError as err:
        told = unused_parameters_error(err, find_unused_parameters)
        return str(told) if told is not None else f"DDP's own error: {err}"
    return "trained"


def _parts(model, cfg):
    """The TrainParts of one worker on the CPU: the model under cfg's strategy, SGD at lr 1
    (a step is the gradient), no schedule, no loss scaling."""
    from ray_ddp.parallel.build import build_strategy
    from ray_ddp.worker.parts import TrainParts

    cpu = torch.device("cpu")
    strategy = build_strategy(cfg)
    wrapped = strategy.setup_module(model, [cpu])
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    return TrainParts(model, wrapped, wrapped, optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0),
                      torch.amp.GradScaler("cpu", enabled=False), [cpu], strategy)


class _Batches:
    """A source of fixed micro-batches: (inputs, targets, this rank's rows in the step);
    ``steps``: more than one step's (a list of them, one per step)."""

    def __init__(self, batches, steps=None):
        self.steps = steps if steps is not None else [batches]

    def micro_batch(self, epoch, step, micro):
        return self.steps[step % len(self.steps)][micro]

    def stand_in(self):
        """A real row of the data, as every source gives one (worker/step.py)."""
        from ray_ddp.tasks.batches import batch_rows

        return next(((x, y) for batch in self.steps for x, y, _ in batch if batch_rows(y)), None)


def _whole(p: torch.Tensor) -> torch.Tensor:
    full = getattr(p, "full_tensor", None)  # FSDP's shards, gathered
    return (full() if full is not None else p).detach().clone()


def write_a_sharded_checkpoint(rank: int, world: int, folder: str, strategy: str = "fsdp") -> int:
    """Two AdamW steps of a GPT sharded over this group (FSDP; or HSDP, 2 ranks a shard
    group), each rank on rows of its own, then ray_ddp's sharded checkpoint of it in ``folder``/step-00000002, every rank
    writing its shards as the worker loop does; the whole weights' hash."""
    import pyarrow.fs as pafs

    from ray_ddp.checkpoint.format import TrainState
    from ray_ddp.checkpoint.sharded import ShardedCheckpointWriter
    from ray_ddp.checkpoint.verify import weights_hash

    model, optimizer = _sharded_gpt(seed=0, strategy=strategy)
    if strategy == "hsdp":  # replicated across the groups, sharded within one
        assert [type(p).__name__ for p in next(model.parameters()).placements] == ["Replicate", "Shard"]
    ids = torch.randint(0, 16, (4, 4), generator=torch.Generator().manual_seed(rank))
    for _ in range(2):
        optimizer.zero_grad()
        model(ids).float().pow(2).mean().backward()
        optimizer.step()
    writer = ShardedCheckpointWriter(pafs.LocalFileSystem(), lambda name: f"{folder}/{name}", rank)
    state = TrainState(epoch=1, step=2, rng=[{"torch": torch.get_rng_state()}] * world)
    snapshot = writer.snapshot(model, optimizer, {}, state, {"config": {"model": "gpt"}}, "step-00000002",
                               final=False)
    writer.write(snapshot, "step-00000002")
    return weights_hash(model)


def load_a_sharded_checkpoint(rank: int, world: int, folder: str, strategy: str = "fsdp") -> tuple[int, int]:
    """A fresh GPT (other weights) sharded over this group, loaded from ``folder``'s
    step-00000002 as a resume does: its whole weights' hash, and AdamW's step count."""
    from ray_ddp.checkpoint.sharded import load_sharded_checkpoint
    from ray_ddp.checkpoint.verify import weights_hash

    model, optimizer = _sharded_gpt(seed=1, strategy=strategy)
    loaded = load_sharded_checkpoint(f"{folder}/step-00000002", model, optimizer)
    assert (loaded.epoch, loaded.step) == (1, 2)
    return weights_hash(model), int(optimizer.state_dict()["state"][0]["step"])


def _sharded_gpt(seed: int, strategy: str = "fsdp", shard_size: int = 2):
    from ray_ddp.config.train import TrainConfig
    from ray_ddp.models.builtin import GPT
    from ray_ddp.parallel.build import build_strategy
    from ray_ddp.parallel.fsdp import shard_model

    torch.manual_seed(seed)
    cpu = torch.device("cpu")
    cfg = TrainConfig(strategy=strategy, model="gpt", fsdp_shard_size=shard_size if strategy == "hsdp" else None)
    model = shard_model(GPT(vocab_size=16, width=8, depth=2, heads=2, seq_len=4), cfg, cpu,
                        build_strategy(cfg).mesh(cpu))
    return model, torch.optim.AdamW(model.parameters(), lr=0.01)


class _CheckpointOf:
    """What Ray hands a restarted rank (``ray.train.Checkpoint``): a path and its local
    folder, here a different folder for each rank (a node's own download)."""

    def __init__(self, path: str, local: Optional[str]):
        self.path, self.local = path, local

    def as_directory(self):
        import contextlib

        if self.local is None:  # the node's download failed (a dropped connection)
            raise ConnectionResetError("the download of the checkpoint was cut off")
        return contextlib.nullcontext(self.local)


def resume_where_one_rank_cannot_read_the_newest(rank: int, world: int, storage: str,
                                                 torn: bool = True) -> tuple[int, str]:
    """ray_ddp's choice of the checkpoint to resume on each rank of a group restarted
    within a run: Ray hands back step 20's (newer than the driver's step 10), but rank 1's
    download of it is torn (``torn``) or fails (a transient remote read). The step each
    rank resumed at, or the error that stopped it."""
    from ray_ddp.checkpoint.resume import check_ranks_resumed_alike, load_checkpoint_to_resume
    from ray_ddp.record.folder import run_folder
    from ray_ddp.storage import resolve_storage
    from ray_ddp.checkpoint.verify import weights_hash
    from ray_ddp.config.train import TrainConfig
    from ray_ddp.models.builtin import ToyModel
    from ray_ddp.parallel.build import build_strategy

    cfg = TrainConfig(storage=storage, name="r")
    model = ToyModel()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    newest = f"{storage}/r/step-00000020"
    latest = _CheckpointOf(newest, newest if rank == 0 else f"{storage}/torn-step-00000020" if torn else None)
    try:
        state = load_checkpoint_to_resume(cfg, run_folder(resolve_storage(cfg.storage), cfg.name), "step-00000010", "step-00000010", latest, build_strategy(cfg),
                                          model, optimizer, {})
        check_ranks_resumed_alike(state.step, lambda: weights_hash(model))
    except Exception as err:
        return -1, str(err)
    return state.step, ""


def check_a_mix_of_resumed_steps(rank: int, world: int) -> str:
    """Each rank says it resumed at another step: the error every rank stops with."""
    from ray_ddp.checkpoint.resume import check_ranks_resumed_alike

    try:
        check_ranks_resumed_alike(10 * (rank + 1), lambda: 12345)
    except Exception as err:
        return str(err)
    return ""


def resume_with_node_snapshots(rank: int, world: int, storage: str, nodes: list, chunk: int = 0) -> tuple:
    """ray_ddp's choice between run storage (step 10's checkpoint) and this rank's node's
    in-memory snapshots (``nodes[rank]``: its node's snapshot folder, RAY_DDP_SNAPSHOT_DIR;
    ``chunk``: the bytes of each broadcast of a snapshot sent to a node without it):
    the step each rank resumed at, the state's source, its node, and a sum of its weights."""
    import os

    from ray_ddp.checkpoint.resume import check_ranks_resumed_alike, load_checkpoint_to_resume
    from ray_ddp.record.folder import run_folder
    from ray_ddp.storage import resolve_storage
    from ray_ddp.checkpoint.verify import weights_hash
    from ray_ddp.config.train import TrainConfig
    from ray_ddp.models.builtin import ToyModel
    from ray_ddp.parallel.build import build_strategy

    import ray_ddp.checkpoint.snapshots as snapshots

    os.environ["RAY_DDP_SNAPSHOT_DIR"] = nodes[rank]
    snapshots.FETCH_CHUNK = chunk or snapshots.FETCH_CHUNK  # small: a file sent in many broadcasts
    cfg = TrainConfig(storage=storage, name="r")
    model = ToyModel()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    state = load_checkpoint_to_resume(cfg, run_folder(resolve_storage(cfg.storage), cfg.name), "step-00000010", "step-00000010", None, build_strategy(cfg),
                                      model, optimizer, {}, node_id=f"node-{rank}")
    check_ranks_resumed_alike(state.step, lambda: weights_hash(model))
    return state.step, state.loaded_from, state.loaded_from_node, model.state_dict()["net1.weight"].sum().item()


def snapshot_cadence_by_cost(rank: int, world: int) -> list:
    """The default cadence of snapshots as the ranks agree it at window ends: due
    SNAPSHOT_FIRST_S after the start, then not until rank 0's clock has passed the last
    one's cost / SNAPSHOT_SHARE."""
    import time
    from types import SimpleNamespace

    from ray_ddp.worker.report import SNAPSHOT_FIRST_S, SNAPSHOT_SHARE, Reporter

    reporter = Reporter(SimpleNamespace(rank=rank, world_size=world), 1e9, torch.device("cpu"), None)
    reporter.snapshots_by_cost = True
    seen = [reporter.agree(False, False).snapshot]  # not yet
    reporter.last_snapshot -= SNAPSHOT_FIRST_S if rank == 0 else 0  # rank 0's clock is the one
    seen.append(reporter.agree(False, False).snapshot)
    reporter.note_snapshot(time.perf_counter() - 1.0)  # it took a second
    seen.append(reporter.agree(False, False).snapshot)
    reporter.last_snapshot -= reporter.snapshot_s / SNAPSHOT_SHARE  # as long after it as it may cost
    seen.append(reporter.agree(False, False).snapshot)
    return seen


def resume_from_shard_snapshots(rank: int, world: int, root: str) -> dict:
    """A GPT sharded over the group takes 3 AdamW steps, each rank on rows of its own,
    snapshotted after steps 2 and 3 into two layouts of nodes (``RAY_DDP_SNAPSHOT_DIR``:
    the node's memory): one node for both ranks, and a node per rank. A fresh model then
    resumes from them as a restarted group does, in turn: on one node; each rank on its
    own node; each on the other's (its shards sent over the group); with the step-3 slot
    of rank 1's node cut short; with rank 1's node lost. What each resume loaded (step,
    the node its shards came from, the weights' hash, AdamW's step count), and the
    weights' hash after each step."""
    import os
    import shutil

    import torch.distributed as dist

    from ray_ddp.checkpoint.format import TrainState
    from ray_ddp.record.names import META_FILE
    from ray_ddp.checkpoint.resume import load_checkpoint_to_resume
    from ray_ddp.record.folder import run_folder
    from ray_ddp.storage import resolve_storage
    from ray_ddp.checkpoint.shard_snapshots import NodeShardSnapshots
    from ray_ddp.checkpoint.snapshots import node_folder, read_meta
    from ray_ddp.checkpoint.verify import weights_hash
    from ray_ddp.config.train import TrainConfig
    from ray_ddp.parallel.build import build_strategy

    cfg = TrainConfig(strategy="fsdp", model="gpt", storage=root, name="r")

    def folder_on(node: str) -> str:
        os.environ["RAY_DDP_SNAPSHOT_DIR"] = os.path.join(root, node)
        return node_folder(root, "r")

    model, optimizer = _sharded_gpt(seed=0)
    writers = [NodeShardSnapshots(folder_on("one"), 1, "one", lowest=rank == 0),
               NodeShardSnapshots(folder_on(f"node{rank}"), 1, f"node{rank}", lowest=True)]
    ids = torch.randint(0, 16, (4, 4), generator=torch.Generator().manual_seed(rank))
    hashes = {}
    for step in (1, 2, 3):
        optimizer.zero_grad()
        model(ids).float().pow(2).mean().backward()
        optimizer.step()
        hashes[step] = weights_hash(model)
        if step >= 2:
            for writer in writers:
                writer.write(model, optimizer, {}, TrainState(step=step, epoch_step=step), {}, rank, world)

    def resume(node: str) -> tuple:
        folder_on(node)
        fresh, fresh_optimizer = _sharded_gpt(seed=1)
        state = load_checkpoint_to_resume(cfg, run_folder(resolve_storage(cfg.storage), cfg.name), None, None, None, build_strategy(cfg), fresh, fresh_optimizer, {},
                                          node_id=node)
        steps = fresh_optimizer.state_dict()["state"]
        return state.step, state.loaded_from_node, weights_hash(fresh), int(steps[0]["step"]) if steps else 0

    got = {"one node": resume("one"), "own node": resume(f"node{rank}"), "swapped": resume(f"node{1 - rank}")}
    if rank == 1:  # the newest slot of rank 1's node loses its meta.json: cut short
        newest = next(path for path in (os.path.join(writers[1].folder, slot) for slot in ("slot-a", "slot-b"))
                      if (read_meta(path) or {}).get("step") == 3)
        os.remove(os.path.join(newest, META_FILE))
    dist.barrier()
    got["cut short"] = resume(f"node{rank}")
    dist.barrier()
    if rank == 1:  # rank 1's node is lost; it restarts on a new one
        shutil.rmtree(os.path.join(root, "node1"))
    dist.barrier()
    got["node lost"] = resume(f"node{rank}" if rank == 0 else "node2")
    return {"hashes": hashes, **got}


def shard_snapshot_edges(rank: int, world: int, root: str) -> tuple:
    """Two edges of sharded snapshots, both ranks on one node: a group restarted from an
    older state (its first snapshot, step 5, finds slots of steps 5 and 6 that a group
    before it left: both go, so no node mixes the two groups' shards); and a rank whose
    slot cannot be written (a file where its folder goes, as a full /dev/shm fails): every
    rank turns snapshots off, rank 0 says why, and no slot is left whole. The slots' steps
    before and after the restart, each rank's reason, and whether any slot is whole."""
    import os

    import torch.distributed as dist

    from ray_ddp.checkpoint.format import TrainState
    from ray_ddp.checkpoint.shard_snapshots import NodeShardSnapshots, held_slots

    model, optimizer = _sharded_gpt(seed=0)
    node = os.path.join(root, "node")
    earlier = NodeShardSnapshots(node, 1, "n", lowest=rank == 0)
    for step in (5, 6):
        earlier.write(model, optimizer, {}, TrainState(step=step, epoch_step=step), {}, rank, world)
    dist.barrier()
    before = sorted(held.step for held in held_slots(node, world))
    dist.barrier()
    restarted = NodeShardSnapshots(node, 1, "n", lowest=rank == 0)
    restarted.write(model, optimizer, {}, TrainState(step=5, epoch_step=5), {}, rank, world)
    dist.barrier()
    after = sorted(held.step for held in held_slots(node, world))
    full = os.path.join(root, f"full-{rank}")
    os.makedirs(full)
    if rank == 1:
        for slot in ("slot-a", "slot-b"):
            open(os.path.join(full, slot), "w").close()
    broken = NodeShardSnapshots(full, 1, f"node-{rank}", lowest=True)
    broken.write(model, optimizer, {}, TrainState(step=7, epoch_step=7), {}, rank, world)
    return before, after, broken.off_because, bool(held_slots(full, world))


def resume_hsdp_when_a_node_is_lost(rank: int, world: int, root: str) -> tuple:
    """HSDP over 2 ranks, each its own shard group (``--fsdp-shard-size 1``): the two are
    replicas, each rank on a node of its own. 3 AdamW steps, snapshots after steps 2 and
    3; rank 1's node is lost, and rank 1 restarts on a new node: its shards are its
    replica's, sent from rank 0's node. What the resume loaded (step, the node its shards
    came from, the weights' hash, AdamW's step count), and the hash after step 3."""
    import os
    import shutil

    import torch.distributed as dist

    from ray_ddp.checkpoint.format import TrainState
    from ray_ddp.checkpoint.resume import load_checkpoint_to_resume
    from ray_ddp.checkpoint.shard_snapshots import NodeShardSnapshots
    from ray_ddp.checkpoint.snapshots import SNAPSHOT_DIR_ENV, node_folder
    from ray_ddp.checkpoint.verify import weights_hash
    from ray_ddp.config.train import TrainConfig
    from ray_ddp.parallel.build import build_strategy
    from ray_ddp.record.folder import run_folder
    from ray_ddp.storage import resolve_storage

    cfg = TrainConfig(strategy="hsdp", fsdp_shard_size=1, model="gpt", storage=root, name="r")
    os.environ[SNAPSHOT_DIR_ENV] = os.path.join(root, f"node{rank}")
    model, optimizer = _sharded_gpt(seed=0, strategy="hsdp", shard_size=1)
    writer = NodeShardSnapshots(node_folder(root, "r"), 1, f"node{rank}", lowest=True)
    ids = torch.randint(0, 16, (4, 4), generator=torch.Generator().manual_seed(rank))
    for step in (1, 2, 3):
        optimizer.zero_grad()
        model(ids).float().pow(2).mean().backward()
        optimizer.step()
        if step >= 2:
            writer.write(model, optimizer, {}, TrainState(step=step, epoch_step=step), {}, rank, world)
    dist.barrier()
    if rank == 1:  # rank 1's node is lost with its shards; it restarts on a new node
        shutil.rmtree(os.path.join(root, "node1"))
        os.environ[SNAPSHOT_DIR_ENV] = os.path.join(root, "node2")
    dist.barrier()
    fresh, fresh_optimizer = _sharded_gpt(seed=1, strategy="hsdp", shard_size=1)
    state = load_checkpoint_to_resume(cfg, run_folder(resolve_storage(root), "r"), None, None, None,
                                      build_strategy(cfg), fresh, fresh_optimizer, {},
                                      node_id="node0" if rank == 0 else "node2")
    steps = fresh_optimizer.state_dict()["state"]
    return (state.step, state.loaded_from_node, weights_hash(fresh), int(steps[0]["step"]) if steps else 0,
            weights_hash(model))
