"""A run directory: its layout, checkpoints (published atomically, checksummed, sharded or not) and
reading it back as a model (``load.load_run``). Training, inference, conversion and export stand on it;
it imports none of them."""
