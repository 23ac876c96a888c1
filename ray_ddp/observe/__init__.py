"""What a run tells: the metrics callback and its schema, stragglers, TensorBoard, the
runs listing and the report."""
