"""Dispatchers: move tokens to their experts' rows and back. They hold no weights."""

from moekit.dispatch.local import DispatchMeta, LocalDispatcher

__all__ = ["DispatchMeta", "LocalDispatcher"]
