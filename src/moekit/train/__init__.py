"""Training: data, loop, checkpoints, metrics."""
