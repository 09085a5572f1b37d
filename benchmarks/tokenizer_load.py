#!/usr/bin/env python
"""`load_model` with the direct tokenizer read against `AutoTokenizer`, in fresh processes, side by side.

For each preset and round, two new processes load the model the way every command does
(`rocketkv_cli.model.loading.load_model`): `direct` as shipped (the tokenizer read straight from
tokenizer.json once it was verified equal, `load_tokenizer`), and `auto` with the direct read
disabled, so `AutoTokenizer` builds the model's own tokenizer class (the code before the direct
read). The two take turns, so a busy machine shifts them alike. Each child prints the seconds
of `load_model` and of one more tokenizer load on its own; the parent prints their ranges. A
first `direct` load per preset (not timed) records the verdict when it is not there yet.

    python benchmarks/tokenizer_load.py [--presets gemma-3-270m smollm2-135m] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

CHILD = """
import json, sys, time
from rocketkv_cli.model import loading
import transformers  # imported before the clock starts, as the CLI does
if sys.argv[2] == "auto":
    def refuse(_where):
        raise RuntimeError("direct read disabled")
    loading._direct_tokenizer = refuse
t0 = time.perf_counter()
loading.load_model(sys.argv[1], device="cpu")
t1 = time.perf_counter()
tok = loading.load_tokenizer(loading.resolve_model_dir(sys.argv[1], lambda _m: None)[1])
print(json.dumps({"load_model_s": t1 - t0, "tokenizer_s": time.perf_counter() - t1, "class": type(tok).__name__}))
"""


def child(preset: str, mode: str) -> dict:
    done = subprocess.run([sys.executable, "-c", CHILD, preset, mode], capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"{preset} {mode}: exit {done.returncode}: {(done.stderr.strip().splitlines() or [''])[-1]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--presets", nargs="+", default=["gemma-3-270m", "smollm2-135m"])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    for preset in args.presets:
        child(preset, "direct")  # records the verdict (and warms the page cache)
        runs: dict[str, list[dict]] = {"auto": [], "direct": []}
        t0 = time.perf_counter()
        for _ in range(args.rounds):
            for mode in ("auto", "direct"):
                runs[mode].append(child(preset, mode))
        for mode, rows in runs.items():
            load = [r["load_model_s"] for r in rows]
            tok = [r["tokenizer_s"] for r in rows]
            print(f"{preset} {mode:6s} ({rows[0]['class']}): load_model {min(load):.2f}-{max(load):.2f} s, "
                  f"tokenizer alone {min(tok):.2f}-{max(tok):.2f} s ({len(rows)} runs)")  # fmt: skip
        print(f"{preset}: {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
