"""Driving ray_ddp from Python: the same run as `ray-ddp train`, summary returned."""

from ray_ddp import TrainConfig, run

if __name__ == "__main__":
    summary = run(TrainConfig(model="toy", workers=2, epochs=2, storage="/tmp/ray_ddp_runs",
                              name="api-example"))
    print(f"final loss {summary.final_loss:.4f}; checkpoint {summary.checkpoint}")
