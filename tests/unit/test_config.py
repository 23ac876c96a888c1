"""TrainConfig: defaults, YAML + flags, and the one-line errors (no Ray)."""

import math

import pytest

from ray_ddp.cli.common import config_from_args
from ray_ddp.cli.main import build_parser
from ray_ddp.errors import ConfigError
from ray_ddp.config.train import TrainConfig


def parse(argv):
    return config_from_args(build_parser().parse_args(["train", *argv]))


def test_defaults_are_a_short_toy_run():
    from ray_ddp.driver.resolve import resolve

    cfg = parse([]).validate()
    assert (cfg.model, cfg.workers, cfg.gpus_per_worker, cfg.input_dim, cfg.output_dim) == (
        "toy", None, None, None, None)  # left to the data, or the synthetic data's defaults:
    plan = resolve(cfg, None)
    assert (plan.input_dim, plan.output_dim, plan.steps_per_epoch, plan.batch.global_batch) == (10, 5, 20, 32)
    assert (cfg.keep, cfg.checkpoint_every) == (2, 1)


def test_yaml_keys_and_flag_wins(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("model: mlp\nepochs: 7\nbatch-size: 16\nlr: 0.2\n")
    cfg = parse(["--config", str(path), "--epochs", "2"])
    assert (cfg.model, cfg.epochs, cfg.batch_size, cfg.lr) == ("mlp", 2, 16, 0.2)


def test_every_flag_is_a_yaml_key(tmp_path):
    # The flags are generated from the fields, so each one must round-trip through YAML.
    cfg = TrainConfig(model="mlp", workers=3, gpus_per_worker=0, backend="gloo", epochs=4,
                      steps_per_epoch=5, batch_size=6, lr=0.5, seed=9, name="x", keep=3,
                      checkpoint_every=2, max_failures=1, json=True)
    import yaml

    path = tmp_path / "all.yaml"
    path.write_text(yaml.safe_dump(cfg.to_dict()))
    assert TrainConfig.from_yaml(str(path)) == cfg


@pytest.mark.parametrize("values, fragment", [
    ({"workers": 0}, "--workers must be a positive integer"),
    ({"epochs": -1}, "--epochs must be a positive integer"),
    ({"steps_per_epoch": 0}, "--steps-per-epoch must be a positive integer"),
    ({"batch_size": 0}, "--batch-size must be a positive integer"),
    ({"lr": 0.0}, "--lr must be a positive finite number"),
    ({"lr": math.inf}, "--lr must be a positive finite number"),
    ({"lr": math.nan}, "--lr must be a positive finite number"),
    ({"model": "resnet"}, "unknown model 'resnet'"),
    ({"gpus_per_worker": 3}, "--gpus-per-worker must be 0, 1 or 2"),
    ({"name": "a/b"}, "must be a plain folder name"),
    ({"name": ".."}, "must be a plain folder name"),
    ({"name": "a..b"}, "must not contain '..'"),
    ({"backend": "nccl", "gpus_per_worker": 0}, "--backend nccl needs GPUs"),
    ({"snapshot_every_steps": -1}, "--snapshot-every-steps must be 0 (off) or positive, got -1"),
])
def test_invalid_values_are_one_line(values, fragment):
    with pytest.raises(ConfigError) as err:
        TrainConfig(**values).validate()
    assert fragment in str(err.value) and "\n" not in str(err.value)


def test_a_negative_snapshot_every_steps_is_one_line_from_flags_and_yaml(tmp_path):
    # 0 turns snapshots off and None leaves them to the cadence by cost; below 0 means neither
    (tmp_path / "c.yaml").write_text("snapshot-every-steps: -3\n")
    for cfg in (parse(["--snapshot-every-steps", "-3"]), TrainConfig.from_yaml(str(tmp_path / "c.yaml"))):
        with pytest.raises(ConfigError) as err:
            cfg.validate()
        assert str(err.value) == "--snapshot-every-steps must be 0 (off) or positive, got -3"
    assert TrainConfig(snapshot_every_steps=0).validate().snapshot_every_steps == 0
    assert TrainConfig().validate().snapshot_every_steps is None


def test_unknown_key_and_wrong_type(tmp_path):
    with pytest.raises(ConfigError, match="unknown config key 'epoch'"):
        TrainConfig.from_dict({"epoch": 3})
    with pytest.raises(ConfigError, match="config key 'epochs' must be int"):
        TrainConfig.from_dict({"epochs": "three"})
    with pytest.raises(ConfigError, match="config key 'epochs' must be int"):
        TrainConfig.from_dict({"epochs": 2.5})


def test_bad_yaml_files(tmp_path):
    with pytest.raises(ConfigError, match="config file not found"):
        TrainConfig.from_yaml(str(tmp_path / "missing.yaml"))
    bad = tmp_path / "bad.yaml"
    bad.write_text("epochs: [1, 2\n")
    with pytest.raises(ConfigError, match="not valid YAML at line"):
        TrainConfig.from_yaml(str(bad))
    listy = tmp_path / "list.yaml"
    listy.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="must hold a mapping"):
        TrainConfig.from_yaml(str(listy))


def test_workers_takes_a_number_or_an_elastic_range_from_flags_yaml_and_python(tmp_path):
    from ray_ddp.cli.common import config_from_args
    from ray_ddp.cli.main import build_parser
    from ray_ddp.config.workers import worker_range

    (tmp_path / "elastic.yaml").write_text('workers: "2-8"\n')
    (tmp_path / "bare.yaml").write_text("workers: 2-8\n")  # YAML reads this as the string too
    for cfg in (TrainConfig.from_yaml(str(tmp_path / "elastic.yaml")),
                TrainConfig.from_yaml(str(tmp_path / "bare.yaml")),
                config_from_args(build_parser().parse_args(["train", "--workers", "2-8"])),
                TrainConfig(workers="2 - 8")):
        assert cfg.validate().workers == "2-8" and worker_range(cfg.validate().workers) == (2, 8)
    fixed = config_from_args(build_parser().parse_args(["train", "--workers", "3"])).validate()
    assert fixed.workers == 3 and worker_range(fixed.workers) == (3, 3)
    assert TrainConfig(workers="4-4").validate().workers == 4  # a range of one size is fixed
    assert worker_range(None) is None
