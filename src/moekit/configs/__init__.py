"""TOML presets for ``moekit train --preset NAME``."""
