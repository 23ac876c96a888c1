"""The driver: ``run`` and what it does around TorchTrainer.fit() (start, restarts,
status, progress, summary)."""
