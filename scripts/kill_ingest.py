#!/usr/bin/env python
"""Kill an ingest with SIGKILL at random points; check the old file is intact and no junk remains.

Usage: python scripts/kill_ingest.py [--runs 50] [--seed 17] [--json docs/bench/kill_ingest.json]

With the installed `rocketkv` and a tiny random-init Llama (the one `tests/` builds), a cache
`out.kv` of a short document is replaced with `--force` by a cache of a longer document ingested
in segments (so there are checkpoints and a final write to interrupt). Each run is killed with
SIGKILL: anywhere in the run (a uniform time over a measured uncut run), anywhere after the model
load, while a random checkpoint is being written, or while the final file is being written (the
moment a temporary file appears).
After each kill: `out.kv` must be the old file byte for byte, or — when the kill came after the
rename — a complete cache of the new document. Then the same command is rerun to completion (it
resumes from the checkpoints); afterwards there must be no `.rocketkv-*.tmp` anywhere and no
checkpoint folder. `out.kv` is then put back to the old file for the next run.

Writes the runs as JSON (`--json`); `scripts/reliability_report.py` renders them into
docs/reliability.md. Exit status 1 when any run broke a rule. Takes about 10–15 minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

from rocketkv_cli.eval.reports import report_timer, write_json

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

ROCKETKV = str(Path(sys.executable).parent / "rocketkv")
SEGMENT_TOKENS = 400
MODES = ("anywhere", "prefill", "checkpoint write", "final write")


def junk(folder: Path) -> list[str]:
    """rocketkv's leftovers under `folder`: temporary files and checkpoint folders."""
    found = [str(p.relative_to(folder)) for p in folder.rglob(".rocketkv-*.tmp")]
    return found + [str(p.relative_to(folder)) + "/" for p in folder.glob(".*.segments")]


class Run:
    """One `rocketkv ingest` in a subprocess, its stderr lines collected as they come."""

    def __init__(self, argv: list[str], env: dict):
        self.proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
        self.lines: list[str] = []
        self.loaded_at: float | None = None  # monotonic time of the "loaded" line
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            if self.loaded_at is None and "loaded" in line:
                self.loaded_at = time.monotonic()
            self.lines.append(line.rstrip("\n"))

    def kill(self) -> bool:
        """SIGKILL now; False when the process had already finished."""
        if self.proc.poll() is not None:
            return False
        self.proc.send_signal(signal.SIGKILL)
        return True

    def wait(self) -> int:
        code = self.proc.wait(timeout=600)
        self.reader.join(timeout=10)
        return code


def phase(lines: list[str], n_segments: int) -> str:
    """Where the run was, from what it had logged."""
    if not any("loaded" in line for line in lines):
        return "start-up, model load"
    done = sum(1 for line in lines if line.startswith("rocketkv: segment "))
    if done < n_segments:
        return f"prefill of segment {done}"
    return "final write"


def wait_for_temp(folder: Path, run: Run, deadline: float, after_segments: int | None = None) -> bool:
    """Poll until a rocketkv temporary file exists in `folder` (and, with `after_segments`, that
    many segments are logged); False when the run ended or time ran out first."""
    logged = lambda: sum(1 for x in run.lines if x.startswith("rocketkv: segment "))  # noqa: E731
    while time.monotonic() < deadline and run.proc.poll() is None:
        if after_segments is not None and logged() < after_segments:
            time.sleep(0.0005)
            continue
        try:
            if any(e.name.startswith(".rocketkv-") and e.name.endswith(".tmp") for e in os.scandir(folder)):
                return True
        except FileNotFoundError:
            pass
        time.sleep(0.0002)
    return False


def state_of(out: Path, old: bytes, new_doc_sha: str) -> str:
    """'old' (byte for byte), 'new' (a complete cache of the new document) or what is wrong."""
    from rocketkv_cli.errors import CacheFormatError
    from rocketkv_cli.store.format import load_cache

    if not out.exists():
        return "MISSING"
    data = out.read_bytes()
    if data == old:
        return "old"
    try:
        cache = load_cache(out)
        for part in getattr(cache, "segments", (cache,)):
            part.layers  # noqa: B018  (every segment read and verified)
    except CacheFormatError as exc:
        return f"BROKEN ({exc.message})"
    return "new" if cache.info.document_sha256 == new_doc_sha else "OTHER CACHE"


def restore(out: Path, old: bytes) -> None:
    tmp = out.with_name("restore.part")
    tmp.write_bytes(old)
    os.replace(tmp, out)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=50, help="runs killed (runs that end first do not count)")
    parser.add_argument("--seed", type=int, default=17)
    parser.add_argument("--json", type=Path, default=ROOT / "docs" / "bench" / "kill_ingest.json")
    args = parser.parse_args()
    from conftest import text_of_bytes
    from test_reliability import save_tiny_llama

    rng = random.Random(args.seed)
    with tempfile.TemporaryDirectory() as tmp:
        ws = Path(tmp)
        env = {**os.environ, "ROCKETKV_HOME": str(ws / "home"), "HF_HUB_OFFLINE": "1"}
        save_tiny_llama(ws / "model")
        work = ws / "work"
        work.mkdir()
        old_doc, new_doc, out = ws / "old.txt", ws / "new.txt", work / "out.kv"
        old_doc.write_text(text_of_bytes(600, 1) + "\nThe code is 1111.\n")
        new_doc.write_text("".join(text_of_bytes(70, i) + "\n" for i in range(45)) + "The code is 2222.\n")
        new_sha = hashlib.sha256(new_doc.read_bytes()).hexdigest()
        subprocess.run(
            [ROCKETKV, "ingest", old_doc, "-o", out, "--model", ws / "model", "-q"],
            env=env,
            check=True,
            stdout=subprocess.DEVNULL,
        )
        old = out.read_bytes()
        argv = [ROCKETKV, "ingest", str(new_doc), "-o", str(out), "--force", "--segment-tokens", str(SEGMENT_TOKENS),
                "--model", str(ws / "model"), "--json"]  # fmt: skip
        t0 = time.monotonic()
        first = subprocess.run(argv, env=env, capture_output=True, text=True, check=True)
        uncut_s = time.monotonic() - t0
        n_segments = json.loads(first.stdout)["n_segments"]
        restore(out, old)
        calibration = Run(argv, env)  # how long the work after the model load takes
        calibration.wait()
        assert calibration.loaded_at is not None, calibration.lines
        work_s = time.monotonic() - calibration.loaded_at
        restore(out, old)
        print(f"uncut run: {uncut_s:.1f}s ({work_s:.1f}s after the model load), {n_segments} segments; "
              f"{args.runs} kills", file=sys.stderr)  # fmt: skip
        rows: list[dict] = []
        for i in range(2 * args.runs):  # until `runs` runs were killed (one can finish before its kill point)
            if sum(1 for r in rows if r["killed"]) == args.runs:
                break
            mode = MODES[0] if i % 2 == 0 else rng.choice(MODES[1:])
            run, started = Run(argv, env), time.monotonic()
            hit = True
            if mode == "anywhere":  # a uniform time over a whole run
                time.sleep(rng.uniform(0, 0.95 * uncut_s))
            elif mode == "prefill":  # a uniform time over the work after the model load
                while run.loaded_at is None and run.proc.poll() is None:
                    time.sleep(0.001)
                time.sleep(rng.uniform(0, 0.9 * work_s))
            else:  # the moment a temporary file appears: checkpoint k (random) or the final file
                k = rng.randrange(n_segments) if mode == "checkpoint write" else n_segments
                folder = work / f".{out.name}.segments" if mode == "checkpoint write" else work
                hit = wait_for_temp(folder, run, started + 300, k)
                time.sleep(rng.uniform(0, 0.002))
            killed = run.kill()
            kill_s = time.monotonic() - started
            code = run.wait()
            where = phase(run.lines, n_segments) if killed else "(had finished)"
            after_kill = state_of(out, old, new_sha)
            left = junk(work)
            rerun = subprocess.run(argv, env=env, capture_output=True, text=True)
            resumed = sum(1 for line in rerun.stderr.splitlines() if "found checkpointed" in line)
            after_rerun = state_of(out, old, new_sha)
            left_after = junk(work)
            ok = after_kill in ("old", "new") and rerun.returncode == 0 and after_rerun == "new" and not left_after
            ok = ok and (not killed or code == -signal.SIGKILL)
            rows.append({"run": i, "mode": mode, "hit_window": hit, "killed": killed, "exit": code,
                         "kill_s": round(kill_s, 3), "phase": where, "target_after_kill": after_kill,
                         "junk_after_kill": left, "rerun_exit": rerun.returncode, "rerun_resumed_segments": resumed,
                         "target_after_rerun": after_rerun, "junk_after_rerun": left_after, "ok": ok})  # fmt: skip
            aim = "" if hit else " (the run ended first)"
            print(f"{'ok  ' if ok else 'FAIL'} run {i}: {mode}{aim}, killed at {kill_s:.2f}s ({where}); "
                  f"target {after_kill}, left {len(left)}; rerun resumed {resumed}, left {len(left_after)}",
                  file=sys.stderr)  # fmt: skip
            restore(out, old)
    command = f"rocketkv ingest new.txt -o out.kv --force --segment-tokens {SEGMENT_TOKENS} --model model --json"
    failures = sum(not r["ok"] for r in rows)
    record = {"runs": rows, "n_segments": n_segments, "uncut_s": round(uncut_s, 2), "work_s": round(work_s, 2),
              "seed": args.seed,
              "segment_tokens": SEGMENT_TOKENS, "failures": failures, "command": command}  # fmt: skip
    write_json(args.json, record, end="\n")
    print(f"wrote {args.json}: {len(rows)} runs, {record['failures']} failed", file=sys.stderr)
    return 1 if record["failures"] else 0


def markdown(record: dict) -> list[str]:
    """The docs/reliability.md section for a record written by this script."""
    rows = record["runs"]
    count = lambda key: Counter(r[key] if not isinstance(r[key], list) else bool(r[key]) for r in rows)  # noqa: E731
    phases = Counter(r["phase"].split(" of segment")[0] for r in rows)
    missed = sum(1 for r in rows if not r["hit_window"])
    left = sum(1 for r in rows if r["junk_after_kill"])
    tmp_left = sum(1 for r in rows if any(x.endswith(".tmp") for x in r["junk_after_kill"]))
    lines = [
        "## kill -9 during an ingest",
        "",
        f"`python scripts/kill_ingest.py` ran `{record['command']}` {len(rows)} times (seed {record['seed']}) and "
        f"killed {sum(1 for r in rows if r['killed'])} of them with SIGKILL (the others ended before their kill "
        "point), each over an old `out.kv` of another document. The document makes {record['n_segments']} "
        f"segments (an uncut run took {record['uncut_s']} s, {record.get('work_s', '?')} s of it after the model "
        "load). Kill points: half at a uniform time over the whole run; the rest at a uniform time after the model "
        "load (`prefill`), or the moment a temporary file appeared while a random checkpoint or the final file was "
        "written. After each kill the same command was rerun to completion.",
        "",
        "| | runs |",
        "| --- | --- |",
        *(f"| killed: {mode} | {n} |" for mode, n in sorted(count("mode").items())),
        *(f"| where the kill landed: {where} | {n} |" for where, n in sorted(phases.items())),
        f"| aimed at a write, but the run ended first | {missed} |",
        *(f"| `out.kv` right after the kill: {st} | {n} |" for st, n in sorted(count("target_after_kill").items())),
        f"| junk right after the kill (temp files or checkpoints) | {left} (with a temp file: {tmp_left}) |",
        f"| rerun resumed from checkpoints | {sum(1 for r in rows if r['rerun_resumed_segments'])} |",
        f"| rerun exit 0 and `out.kv` a complete cache of the new document | "
        f"{sum(1 for r in rows if r['rerun_exit'] == 0 and r['target_after_rerun'] == 'new')} |",
        f"| junk after the rerun | {sum(1 for r in rows if r['junk_after_rerun'])} |",
        f"| **runs that broke a rule** | **{record['failures']}** |",
        "",
        "`old` = byte-identical to the file before the run; `new` = a complete, verified cache of the new document "
        "(the kill came after the rename). A temp file left by the killed run is removed by the rerun (its pid is "
        "dead); a checkpoint folder is resumed from and removed once the file is written.",
        "",
    ]
    return lines


if __name__ == "__main__":
    with report_timer(Path(__file__).name):
        sys.exit(main())
