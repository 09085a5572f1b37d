"""Evaluation and benchmarks, through the same engine, stage-1 methods and kernel dispatch that ship:
RULER-style tasks generated locally (`tasks.py`), the accuracy runner (`runner.py`), and the
speed / size / memory measurements of `rocketkv bench` (`bench.py`)."""
