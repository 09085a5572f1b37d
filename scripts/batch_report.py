#!/usr/bin/env python
"""Measure `rocketkv batch` against its targets and write the numbers into docs/batch.md.

Usage: nohup python scripts/batch_report.py [--rows 200] [--measure-rows 40] [--block 10] &

A manifest of `--rows` short documents (≈1K tokens each: slices of shared/data/kjv.txt) with 3
questions each, on `--model smollm2-135m` (float32, budget 512, answers ≤ `--max-new-tokens`).
The first `--measure-rows` rows are measured in blocks of `--block` rows; for each block, side by
side and one after the other, these modes do the same work (their own fresh cache folders):

- `sum`: one Python process loads the model once and times each row's `RocketKV.ingest` (to a
  `.kv` file) plus its `RocketKV.ask`; the sum of those times, without start-up or model load;
- `batch`: `rocketkv batch BLOCK.jsonl` (1 worker), wall time of the whole command;
- `per-process`: `rocketkv ask DOC Q1 Q2 Q3 --json` once per row, wall time summed;
- `batch-2`: `rocketkv batch --workers 2`; `ray-2`: `rocketkv batch --ray local --workers 2`
  (a 2-worker Ray cluster on this machine, started and stopped by the command).

Wall time and CPU time (user + system, of each command and its children) are recorded. Every
process runs with 1 torch thread (OMP_NUM_THREADS=1, `--threads 1`). Blocks make the run
resumable (state in build/batch-report/state.json: rerun the same command to continue) and
spread a shared machine's noise over all modes alike; each batch command pays its start-up once
per block, so the batch ratios are conservative compared with one command over all the rows.
Ratios are only ever computed from blocks where every mode ran.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ROCKETKV = str(Path(sys.executable).parent / "rocketkv")
QUESTIONS = ["Who is named first in this passage?", "What happens in this passage?", "Which place is mentioned?"]
MODES = ("sum", "batch", "per-process", "batch-2", "ray-2")
START, END = "<!-- batch-report:start -->", "<!-- batch-report:end -->"
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TQDM_DISABLE": "1"}


def find_kjv() -> Path:
    """shared/data/kjv.txt in the repository's folder or above it (where the project keeps it)."""
    for base in (ROOT, *ROOT.parents):
        if (base / "shared" / "data" / "kjv.txt").is_file():
            return base / "shared" / "data" / "kjv.txt"
    sys.exit("shared/data/kjv.txt not found above the repository")


def make_documents(work: Path, rows: int, chars: int) -> list[dict]:
    """`rows` KJV slices of about `chars` characters, cut at line ends, spread over the book."""
    text = find_kjv().read_text(encoding="utf-8")
    docs = work / "docs"
    docs.mkdir(parents=True, exist_ok=True)
    manifest = []
    step = (len(text) - 2 * chars) // rows
    for i in range(rows):
        start = text.index("\n", i * step) + 1
        end = text.index("\n", start + chars) + 1
        path = docs / f"doc{i:03d}.txt"
        if not path.exists():
            path.write_text(text[start:end], encoding="utf-8")
        manifest.append({"id": f"doc{i:03d}", "document": str(path), "questions": QUESTIONS})
    return manifest


def inner_sum(block_file: Path, cache_dir: Path, budget: int, max_new: int) -> None:
    """Mode `sum` (run in its own process): per row, time ingest + answers; print JSON."""
    import torch

    from rocketkv_cli import RocketKV

    torch.set_num_threads(1)
    rk = RocketKV.load("smollm2-135m", device="cpu")
    cache_dir.mkdir(parents=True, exist_ok=True)
    rows = [json.loads(line) for line in block_file.read_text().splitlines()]
    ingest_s = answer_s = cpu_s = 0.0
    for row in rows:
        c0, t0 = time.process_time(), time.perf_counter()
        done = rk.ingest(row["document"], output=cache_dir / f"{row['id']}.kv", force=True, token_budget=budget,
                         max_new_tokens=max_new)  # fmt: skip
        t1 = time.perf_counter()
        answers = list(rk.ask(done.cache, row["questions"], max_new_tokens=max_new))
        t2 = time.perf_counter()
        ingest_s, answer_s, cpu_s = ingest_s + t1 - t0, answer_s + t2 - t1, cpu_s + time.process_time() - c0
        if len(answers) != len(row["questions"]):
            raise RuntimeError(f"{row['id']}: {len(answers)} answers for {len(row['questions'])} questions")
    print(json.dumps({"seconds": ingest_s + answer_s, "cpu_s": cpu_s, "ingest_s": ingest_s, "answer_s": answer_s}))


def children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def timed(cmd: list[str]) -> tuple[float, float]:
    """(wall seconds, CPU seconds of the command and the children it waited for)."""
    c0, t0 = children_cpu_s(), time.perf_counter()
    r = subprocess.run(cmd, env=ENV, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[:4])}… exited {r.returncode}: {r.stderr[-2000:]}")
    return time.perf_counter() - t0, children_cpu_s() - c0


def both(pairs: list[tuple[float, float]]) -> dict:
    return {"seconds": sum(p[0] for p in pairs), "cpu_s": sum(p[1] for p in pairs)}


def run_mode(mode: str, block_file: Path, rows: list[dict], work: Path, budget: int, max_new: int) -> dict:
    """One mode over one block; returns {"seconds": …} (and details)."""
    tag = f"{block_file.stem}-{mode}"
    common = ["--model", "smollm2-135m", "--budget", str(budget), "--max-new-tokens", str(max_new), "-q"]
    batch = [ROCKETKV, "batch", str(block_file), "-o", str(work / f"{tag}.jsonl"), "--cache-dir",
             str(work / f"{tag}-cache"), "--threads", "1", *common]  # fmt: skip
    load = os.getloadavg()[0]
    if mode == "sum":
        cmd = [sys.executable, __file__, "--inner-sum", str(block_file), "--inner-cache", str(work / f"{tag}-cache"),
               "--budget", str(budget), "--max-new-tokens", str(max_new)]  # fmt: skip
        r = subprocess.run(cmd, env=ENV, capture_output=True, text=True, check=True)
        out = json.loads(r.stdout.strip().splitlines()[-1])
    elif mode == "batch":
        out = both([timed(batch)])
    elif mode == "batch-2":
        out = both([timed([*batch, "--workers", "2"])])
    elif mode == "ray-2":  # Ray's worker processes are not this command's waited-for children: no CPU time
        out = {"seconds": timed([*batch, "--ray", "local", "--workers", "2"])[0]}
    elif mode == "per-process":
        out = both([timed([ROCKETKV, "ask", row["document"], *row["questions"], "--json", *common]) for row in rows])
    else:
        raise ValueError(mode)
    out["load_before"] = round(load, 2)
    return out


def measure(args) -> dict:
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    manifest = make_documents(work, args.rows, args.chars)
    (work / "manifest.jsonl").write_text("".join(json.dumps(r) + "\n" for r in manifest))
    state_file = work / "state.json"
    state = json.loads(state_file.read_text()) if state_file.exists() else {}
    settings = {"rows": args.rows, "block": args.block, "chars": args.chars, "budget": args.budget,
                "max_new_tokens": args.max_new_tokens}  # fmt: skip
    if state.get("settings") not in (None, settings):
        sys.exit(f"{state_file} was made with other settings {state['settings']}; remove it or pass the same options")
    state["settings"] = settings
    blocks = state.setdefault("blocks", {})
    for start in range(0, min(args.measure_rows, args.rows), args.block):
        rows = manifest[start : start + args.block]
        block_file = work / f"block{start:03d}.jsonl"
        block_file.write_text("".join(json.dumps(r) + "\n" for r in rows))
        done = blocks.setdefault(str(start), {})
        for mode in MODES:
            if mode in done:
                continue
            print(f"block {start}: {mode} …", file=sys.stderr, flush=True)
            done[mode] = run_mode(mode, block_file, rows, work, args.budget, args.max_new_tokens)
            print(f"block {start}: {mode} {done[mode]['seconds']:.1f}s", file=sys.stderr, flush=True)
            state_file.write_text(json.dumps(state, indent=1))
    return state


def report(state: dict, command: str) -> str:
    s = state["settings"]
    full = {k: v for k, v in state["blocks"].items() if all(m in v for m in MODES)}
    n_rows = sum(min(s["block"], s["rows"] - int(k)) for k in full)
    n = max(n_rows, 1)
    tot = {m: sum(b[m]["seconds"] for b in full.values()) for m in MODES}
    cpu = {m: sum(b[m]["cpu_s"] for b in full.values()) for m in MODES if m != "ray-2"}
    ingest = sum(b["sum"]["ingest_s"] for b in full.values())
    loads = [b[m]["load_before"] for b in full.values() for m in MODES] or [float("nan")]

    def ratio(a: str, b: str, of: dict) -> float:
        return of[a] / of[b] if of.get(b) else float("nan")

    def met(value: float, target: tuple[str, float]) -> str:
        return "yes" if (value <= target[1] if target[0] == "≤" else value >= target[1]) else "**no**"

    out = [
        START,
        f"Measured by `{command}` on this project's 2-core machine, shared with other jobs (1-minute load "
        f"average {min(loads):.1f}–{max(loads):.1f} before the measurements: the wall times are noisy). "
        f"**Measured subset: the first {n_rows} of the {s['rows']} rows** ({len(full)} blocks of {s['block']} "
        "rows, every mode on every block, side by side); the other rows were not run in every mode, and "
        "nothing here is extrapolated to 200 rows. Documents: KJV slices of about "
        f"{s['chars']} characters (≈1K SmolLM2 tokens), 3 questions each, `--model smollm2-135m`, budget "
        f"{s['budget']}, answers ≤ {s['max_new_tokens']} tokens, 1 torch thread per process. Each batch command "
        f"ran once per block, so its start-up (imports, model load; for Ray, the cluster) is paid {len(full)} "
        "times: the batch ratios below are conservative.",
        "",
        "| mode | wall s (sum over blocks) | wall s per row | CPU s | CPU s per row |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    names = {"sum": "ingest + answers in one process (timed calls only)", "batch": "`rocketkv batch` (1 worker)",
             "per-process": "`rocketkv ask DOC Q1 Q2 Q3` per row", "batch-2": "`rocketkv batch --workers 2`",
             "ray-2": "`rocketkv batch --ray local --workers 2`"}  # fmt: skip
    for m in MODES:
        c = f"{cpu[m]:.1f} | {cpu[m] / n:.2f}" if m in cpu else "– | –"
        out.append(f"| {names[m]} | {tot[m]:.1f} | {tot[m] / n:.2f} | {c} |")
    out += [
        "",
        f"Of the one-process sum, ingest took {ingest:.1f} s and answers {tot['sum'] - ingest:.1f} s (wall). CPU s: "
        "user + system time of the command and the processes it waited for (for the one-process sum: of the timed "
        "calls); Ray's workers are not the command's children, so the Ray run has wall time only. Modes run one "
        "after the other see different loads from the other jobs; CPU times are less affected by that.",
        "",
        "| target | ratio | wall | CPU | target | met (wall) | met (CPU) |",
        "| --- | --- | ---: | ---: | --- | --- | --- |",
    ]
    targets = [
        ("batch vs the sum of its ingests and answers in one process", "batch", "sum", ("≤", 1.3)),
        ("one `rocketkv ask DOC Q1 Q2 Q3` process per row vs batch", "per-process", "batch", ("≥", 5.0)),
        ("Ray, local 2-worker cluster, vs local batch with 2 workers", "ray-2", "batch-2", ("≤", 1.5)),
        ("Ray, local 2-worker cluster, vs local batch with 1 worker", "ray-2", "batch", ("≤", 1.5)),
    ]
    for what, a, b, target in targets:
        w = ratio(a, b, tot)
        c_text, c_met = (f"{ratio(a, b, cpu):.2f}", met(ratio(a, b, cpu), target)) if a in cpu else ("–", "–")
        out.append(f"| {what} | {a} / {b} | {w:.2f} | {c_text} | {target[0]} {target[1]:g} | {met(w, target)} "
                   f"| {c_met} |")  # fmt: skip
    out.append(END)
    return "\n".join(out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=200)
    p.add_argument("--measure-rows", type=int, default=200, help="rows measured in every mode (a prefix)")
    p.add_argument("--block", type=int, default=10)
    p.add_argument("--chars", type=int, default=3600, help="characters per document (≈1K tokens)")
    p.add_argument("--budget", type=int, default=512)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--work", default=str(ROOT / "build" / "batch-report"), help="documents, state and results")
    p.add_argument("--doc", default=str(ROOT / "docs" / "batch.md"), help="page whose report section is replaced")
    p.add_argument("--inner-sum", help=argparse.SUPPRESS)
    p.add_argument("--inner-cache", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.inner_sum:
        inner_sum(Path(args.inner_sum), Path(args.inner_cache), args.budget, args.max_new_tokens)
        return
    state = measure(args)
    command = "python scripts/batch_report.py " + " ".join(sys.argv[1:])
    section = report(state, command.strip())
    doc = Path(args.doc)
    text = doc.read_text()
    if START in text and END in text:
        text = text[: text.index(START)] + section + text[text.index(END) + len(END) :]
    else:
        text += "\n" + section + "\n"
    doc.write_text(text)
    print(section)


if __name__ == "__main__":
    main()
