"""Parallelism applied to the single-device model from outside: mesh, ep, tp, pp, FSDP, runtime."""
