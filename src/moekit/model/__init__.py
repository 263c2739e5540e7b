"""Decoder-only transformer language models with dense or MoE blocks (single-device code)."""

from moekit.model.transformer import KVCache, ModelOutput, Transformer

__all__ = ["KVCache", "ModelOutput", "Transformer"]
