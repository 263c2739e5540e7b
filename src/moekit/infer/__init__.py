"""Inference: loading trained runs and generating text."""
