"""rocketkv: ask questions of very long documents with a compressed (RocketKV) KV cache.

The Python API (`RocketKV`, see `rocketkv_cli.api.rocketkv`) is imported on first use, so that
`import rocketkv_cli` (and the CLI's start-up) stays light.
"""

from __future__ import annotations

__version__ = "0.1.0"

from . import methods  # noqa: E402, F401  (torch-free: registers the stage-1 methods that PrefillConfig accepts)

__all__ = ["Answer", "CompressedKVCache", "PrefillConfig", "RocketKV", "SegmentedKVCache", "__version__"]


def __getattr__(name: str):
    if name in ("Answer", "CompressedKVCache", "RocketKV", "SegmentedKVCache"):
        from .api import rocketkv as api

        return getattr(api, name)
    if name == "PrefillConfig":
        from .core.config import PrefillConfig

        return PrefillConfig
    raise AttributeError(f"module 'rocketkv_cli' has no attribute {name!r}")
