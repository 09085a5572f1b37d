"""Stage-1 methods (RocketKV §3.2): one class per file, registered by name.

`registry()` lists them; `method_for(cfg)` builds the one a `PrefillConfig` names. Every module
of this package is imported here (the SnapKV++ tail window first: it is the default), so adding
a method is one new file (a `@register`-ed `Stage1Method` subclass) and its test.
"""

from __future__ import annotations

import importlib
import pkgutil

from . import tail  # noqa: F401  (first: the default method leads every list of choices)
from .base import (
    LayerPrefill,
    Stage1Method,
    method_class,
    method_for,
    register,
    registry,
    unregister,
)

for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")

__all__ = ["LayerPrefill", "Stage1Method", "method_class", "method_for", "register", "registry", "unregister"]
