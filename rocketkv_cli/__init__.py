"""rocketkv: ask questions of very long documents with a compressed (RocketKV) KV cache."""

__version__ = "0.1.0"
