"""Trackers: the places a run's figures go beyond its own folder (MLflow, Weights &
Biases, TensorBoard, Ray's metrics), each one file behind the small protocol of
trackers/base.py."""
