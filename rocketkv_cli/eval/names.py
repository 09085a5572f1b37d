"""The names `rocketkv eval --methods` accepts, from the stage-1 registry (standard library only:
the CLI lists them in its help before torch loads)."""

from __future__ import annotations

from ..methods import registry


def eval_methods() -> tuple[str, ...]:
    """Every method `eval --methods` accepts, derived from the stage-1 registry (`rocketkv_cli.methods`).

    "full" (exact attention, nothing pruned), "hsa" (stage 2 alone over the full cache),
    "rocketkv" (the tail-window method, stage 2 at decode) and "snapkv" (its cache with exact
    attention); then per registered method its name (its cache, stage 2 at decode, except a
    method with `eval_exact` set), and for a method that scores tokens two variants: "_reselect"
    (a store budget of `store_factor`·t, per-question re-selection) and "_adaptive" (adaptive layer
    budgets); the tail window's variants are plain "reselect" and "adaptive".
    """
    names = ["full", "rocketkv", "snapkv", "hsa"]
    for name, cls in registry().items():
        prefix = "" if name == "tail" else f"{name}_"
        names += [] if name == "tail" else [name]
        names += [f"{prefix}reselect", f"{prefix}adaptive"] if cls.selection == "snapkv" else []
    return tuple(names)


# what `rocketkv eval` runs when --methods is not given (the measured set of docs/accuracy.md)
DEFAULT_METHODS = ("full", "rocketkv", "snapkv", "hsa", "sink_recent", "reconstruct", "reselect",
                   "reconstruct_reselect", "adaptive", "reconstruct_adaptive")  # fmt: skip
