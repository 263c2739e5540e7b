"""A run directory's checkpoints: published atomically, checksummed, sharded or not."""
