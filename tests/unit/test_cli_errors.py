"""Every mistake in a command line: one line, exit 2, no traceback, nothing written (no Ray);
and `--help` or a mistyped flag answers without importing torch, pyarrow or Ray."""

import subprocess
import sys

import pytest

from ray_ddp.cli.main import main


@pytest.fixture
def files(tmp_path):
    (tmp_path / "bad.yaml").write_text("epochs: [1, 2\n")
    (tmp_path / "unknown.yaml").write_text("epochs: 2\nbatchsize: 3\n")
    (tmp_path / "a_file").write_text("not a folder")
    return tmp_path


CASES = {
    "workers zero": (["--workers", "0"], "--workers must be a positive integer"),
    "workers negative": (["--workers", "-2"], "--workers must be a positive integer"),
    "epochs zero": (["--epochs", "0"], "--epochs must be a positive integer"),
    "steps zero": (["--steps-per-epoch", "0"], "--steps-per-epoch must be a positive integer"),
    "batch zero": (["--batch-size", "0"], "--batch-size must be a positive integer"),
    "lr negative": (["--lr", "-0.1"], "--lr must be a positive finite number"),
    "lr nan": (["--lr", "nan"], "--lr must be a positive finite number"),
    "lr inf": (["--lr", "inf"], "--lr must be a positive finite number"),
    "unknown model": (["--model", "resnet"], "unknown model 'resnet'"),
    "model import fails": (["--model", "broken_import:build"], "cannot import broken_import"),
    "model not a module": (["--model", "user_models:not_a_module"], "not a torch.nn.Module"),
    "model frozen": (["--model", "user_models:frozen_net"], "no parameter that requires grad"),
    "config missing": (["--config", "{tmp}/missing.yaml"], "config file not found"),
    "config malformed": (["--config", "{tmp}/bad.yaml"], "is not valid YAML"),
    "config unknown key": (["--config", "{tmp}/unknown.yaml"], "unknown config key 'batchsize'"),
    "gpus per worker 3": (["--gpus-per-worker", "3"], "invalid choice: 3"),
    "workers not a number": (["--workers", "two"], "--workers must be a number N or a range MIN-MAX"),
    "workers range upside down": (["--workers", "4-2"], "an elastic range needs 1 <= MIN <= MAX"),
    "workers zero in a range": (["--workers", "0-2"], "an elastic range needs 1 <= MIN <= MAX"),
    "global batch and accumulation": (["--global-batch", "256", "--grad-accum", "2"],
                                      "--global-batch decides the accumulation steps"),
    "max preemptions below -1": (["--max-preemptions", "-2"], "--max-preemptions must be -1"),
    "global batch below the workers": (["--workers", "2-4", "--global-batch", "3"],
                                       "--global-batch 3 gives some of the 4 workers no rows"),
    "storage not writable": (["--storage", "{tmp}/a_file/runs"], "is not writable"),
    "name with a slash": (["--name", "a/b"], "must be a plain folder name"),
    "name with dotdot": (["--name", "x..y"], "must not contain '..'"),
    "no cluster at address": (["--address", "127.0.0.1:1"], "no Ray cluster answers at 127.0.0.1:1"),
    "dashboard as address": (["--address", "http://127.0.0.1:8265"], "a dashboard (job server) address"),
    "negative wait": (["--wait-for-resources", "-1"], "--wait-for-resources must be 0 or more"),
    "unknown task": (["--task", "ranking"], "invalid choice: 'ranking'"),
    "val fraction of 1": (["--val-fraction", "1"], "--val-fraction must be at least 0 and below 1"),
    "val data and fraction": (["--val-data", "x", "--val-fraction", "0.1"], "give --val-data or --val-fraction"),
    "keep best without validation": (["--keep-best"], "--keep-best keeps the checkpoint with the lowest"),
    "loss not a callable path": (["--loss", "mse"], "--loss 'mse' must look like package.module:callable"),
    "loss import fails": (["--loss", "broken_import:fn", "--dataset", "user_data:regression"],
                          "cannot import broken_import"),
    "collate without a dataset": (["--collate", "user_data:collate_dicts"], "--collate is for --dataset"),
    "classification of synthetic data": (["--task", "classification"], "--task classification needs data"),
    "gpt heads": (["--model", "gpt", "--width", "30", "--heads", "4"], "--width 30 must be a multiple of --heads 4"),
    "zero classes": (["--num-classes", "0"], "--num-classes must be a positive integer"),
    "fsdp of toy-mp": (["--strategy", "fsdp", "--model", "toy-mp"], "use --model toy (or mlp) with --strategy fsdp"),
    "fsdp on a gpu pair": (["--strategy", "fsdp", "--gpus-per-worker", "2"], "use --gpus-per-worker 1"),
    "fsdp in fp16": (["--strategy", "fsdp", "--amp", "fp16"], "use --amp bf16"),
    "fsdp with unused parameters": (["--strategy", "fsdp", "--find-unused-parameters"], "drop the flag"),
    "plain ddp with fsdp": (["--strategy", "fsdp", "--plain-ddp"], "--plain-ddp is a DDP setting"),
    "static graph with fsdp": (["--strategy", "fsdp", "--static-graph"], "--static-graph is a DDP setting"),
    "static graph with accumulation": (["--static-graph", "--grad-accum", "2"], "--static-graph cannot accumulate"),
    "bucket size of 0": (["--bucket-mb", "0"], "--bucket-mb must be a positive number of MiB"),
    "fsdp wrap without fsdp": (["--fsdp-wrap", "Block"], "--fsdp-wrap is for --strategy fsdp"),
    "shard size without hsdp": (["--strategy", "fsdp", "--fsdp-shard-size", "2"],
                                "--fsdp-shard-size is for --strategy hsdp"),
    "shard size not dividing the workers": (["--strategy", "hsdp", "--workers", "4", "--fsdp-shard-size", "3"],
                                            "--fsdp-shard-size 3 does not divide --workers 4; give a divisor of 4"),
    "shard size not dividing an elastic range": (["--strategy", "hsdp", "--workers", "2-5", "--fsdp-shard-size", "2"],
                                                 "does not divide every world size of --workers 2-5 (3 is not"),
    "zero shard size": (["--strategy", "hsdp", "--fsdp-shard-size", "0"], "--fsdp-shard-size must be a positive"),
    "hsdp in fp16": (["--strategy", "hsdp", "--amp", "fp16"], "--strategy hsdp trains in bf16"),
    "fsdp wrap naming nothing": (["--strategy", "fsdp", "--model", "mlp", "--fsdp-wrap", "Block"],
                                 "--fsdp-wrap Block names no module of model mlp"),
    "fsdp wrap not importable": (["--strategy", "fsdp", "--fsdp-wrap", "nosuchpkg.Block"],
                                 "--fsdp-wrap nosuchpkg.Block: cannot import it"),
    "fsdp wrap not a module": (["--strategy", "fsdp", "--fsdp-wrap", "torch.Tensor"],
                               "--fsdp-wrap torch.Tensor is not an nn.Module class"),
    "negative hang timeout": (["--hang-timeout", "-1"], "--hang-timeout must be 0 (off) or more seconds"),
    "wait timeout shorter than a step's": (["--hang-timeout", "60", "--wait-timeout", "30"],
                                           "--wait-timeout must be at least --hang-timeout (60 s)"),
    "wait timeout without the watch": (["--hang-timeout", "0", "--wait-timeout", "30"],
                                       "--wait-timeout is the hang watch's, which --hang-timeout 0 turns off"),
    "profile of one number": (["--profile", "5"], "--profile takes START-END"),
    "ray data of synthetic rows": (["--ray-data"], "--ray-data reads parquet through Ray Data; --data synthetic"),
    "ray data of text": (["--ray-data", "--data", "{tmp}/book.txt"], "is not a parquet file or folder"),
    "ray data with stream": (["--ray-data", "--data", "{tmp}/rows", "--stream"], "--ray-data and --stream"),
    "negative loader workers": (["--loader-workers", "-1"], "--loader-workers must be 0"),
    "unreachable mlflow": (["--mlflow", "http://127.0.0.1:9"], "--mlflow http://127.0.0.1:9 cannot be reached"),
    "lora rank not a number": (["--lora", "r=eight"], "--lora r=eight: r and alpha are whole numbers"),
    "lora unknown key": (["--lora", "rank=8"], "unknown key 'rank'; give r, alpha, dropout and targets"),
    "lora rank 0": (["--lora", "r=0"], "r and alpha must be at least 1"),
    "lora empty targets": (["--lora", "targets="], "targets not empty"),
    # the spec fits no layer of the model: on the meta device, before Ray starts
    "lora targets naming nothing": (["--lora", "r=4,targets=q_proj,v_proj"],
                                    "--lora r=4,targets=q_proj,v_proj does not fit model 'toy'"),
}


@pytest.mark.parametrize("case", CASES)
def test_bad_input_is_one_line_and_exit_2(case, files, capsys):
    argv, fragment = CASES[case]
    argv = [a.replace("{tmp}", str(files)) for a in argv]
    storage = files / "runs"
    if "--storage" not in argv:
        argv += ["--storage", str(storage)]
    with pytest.raises(SystemExit) as exit_:
        sys.exit(main(["train", *argv]))
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert fragment in err and len(err.strip().splitlines()) == 1, err
    assert "Traceback" not in err
    assert not storage.exists() or not any(storage.iterdir()), "nothing may be left behind"


def test_a_real_process_prints_one_line_and_exits_2(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "ray_ddp", "train", "--lr", "-1",
                           "--storage", str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert proc.stderr.strip() == "ray-ddp train: error: --lr must be a positive finite number, got -1.0"
    assert proc.stdout == ""


EXPORT_CASES = {
    "unknown run": (["nosuchrun"], "run nosuchrun has no checkpoint under"),
    "unknown step": (["done", "--step", "7"], "run done has no checkpoint at step 7; its newest is step-00000003"),
    "out folder missing": (["done", "--out", "{tmp}/nowhere/m.pt"], "does not exist"),
    "no whole checkpoint": (["torn"], "run torn has no whole checkpoint (step-00000001: meta.json is missing"),
}


@pytest.mark.parametrize("case", EXPORT_CASES)
def test_export_mistakes_are_one_line_and_exit_2(case, tmp_path, capsys, monkeypatch):
    (tmp_path / "runs" / "done" / "step-00000003").mkdir(parents=True)
    (tmp_path / "runs" / "done" / "step-00000003" / "meta.json").write_text('{"files": {}}')
    (tmp_path / "runs" / "torn" / "step-00000001").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    argv, fragment = EXPORT_CASES[case]
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    with pytest.raises(SystemExit) as exit_:
        sys.exit(main(["export", *argv, "--storage", str(tmp_path / "runs")]))
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert fragment in err and len(err.strip().splitlines()) == 1, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["runs"], "nothing written"


_LIGHT_SCRIPT = r"""
import sys
from ray_ddp.cli import main
codes = []
for argv in (["--help"], ["train", "--help"], ["demo", "--help"], ["export", "--help"],
             ["train", "--no-such-flag"], ["demo", "nosuchdemo"]):
    try:
        main(argv)
    except SystemExit as exit_:
        codes.append(exit_.code)
print(codes, sorted(m for m in ("torch", "pyarrow", "ray") if m in sys.modules))
"""


def test_help_and_usage_errors_import_neither_torch_pyarrow_nor_ray(tmp_path):
    """`ray-ddp --help` and a mistyped flag answer at once: every command's module keeps
    its heavy imports in its ``run``, and what its parser needs lives in light modules."""
    proc = subprocess.run([sys.executable, "-c", _LIGHT_SCRIPT], capture_output=True, text=True,
                          cwd=tmp_path, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == "[0, 0, 0, 0, 2, 2] []"
