"""A shell loop of `rocketkv ask` over one cache, with and without a warm `rocketkv serve`, side by
side in one run: what a user scripting questions waits for per question.

    python benchmarks/serve_loop.py                       # both presets, the GPL (8K tokens), 100 questions
    python benchmarks/serve_loop.py --smoke               # SmolLM2, a 600-token slice, 3 questions (CI)

Per preset: the document is ingested once (kept in --workdir, reused by a rerun), then
1. `--in-process` questions are asked as today, one fresh `rocketkv ask --no-server` process each;
2. a server is started on a socket in --workdir, warmed with one question, and `--questions`
   questions are asked by fresh `rocketkv ask --server unix:...` processes (the client imports no
   torch); the first-token latency is timed from the request to the first piece of text, with the
   client library in this process;
3. the answers to the questions asked both ways are compared (greedy: they must be identical).
Each process's wall time is taken around `subprocess.run`. Results go to --out as JSON (a preset
already there is skipped unless --force, so an interrupted run resumes) and print as a table.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from rocketkv_cli.serve.client import Server, events, health  # noqa: E402 (stdlib only)

QUESTIONS = [
    "Can I charge a fee for distributing copies of the program?",
    "What must I provide with the object code?",
    "How long must a written offer for the source code be valid?",
    "What happens to my license if I violate the terms?",
    "Can I add further restrictions to the license?",
    "What is Corresponding Source?",
    "Does the license cover patents?",
    "What are Installation Information requirements for User Products?",
    "Can I convey the work under a later version of the license?",
    "Is there a warranty for the program?",
]


def rocketkv() -> str:
    exe = Path(sys.executable).parent / "rocketkv"
    return str(exe) if exe.exists() else "rocketkv"


def timed(argv: list[str], env: dict) -> tuple[float, subprocess.CompletedProcess]:
    t0 = time.perf_counter()
    done = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=900)
    seconds = time.perf_counter() - t0
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(argv[:4])} … failed ({done.returncode}): {done.stderr.strip()[-500:]}")
    return seconds, done


def start_server(socket: Path, env: dict) -> subprocess.Popen:
    proc = subprocess.Popen([rocketkv(), "serve", "--socket", str(socket), "--idle-timeout", "0"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)  # fmt: skip
    server = Server(path=str(socket))
    deadline = time.monotonic() + 300
    while health(server) is None:
        if proc.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"the server did not start: {proc.stderr.read() if proc.stderr else ''}")
        time.sleep(0.1)
    return proc


def first_token_s(socket: Path, cache: Path, question: str, max_new: int) -> float:
    """Seconds from sending the request to the first piece of the answer (the client in this process)."""
    t0 = time.perf_counter()
    body = {"cache": str(cache), "questions": [question], "max_new_tokens": max_new}
    first = None
    for event in events(Server(path=str(socket)), "/v1/rocketkv/ask", body):
        if event["event"] == "piece" and first is None:
            first = time.perf_counter() - t0
    return first if first is not None else float("nan")


def run_preset(preset: str, doc: Path, work: Path, n_server: int, n_local: int, max_new: int, env: dict) -> dict:
    cache = work / f"{preset}.kv"
    if not cache.exists():
        timed([rocketkv(), "ingest", str(doc), "-o", str(cache), "--model", preset, "--force", "--quiet"], env)
    info = json.loads(timed([rocketkv(), "inspect", str(cache), "--json"], env)[1].stdout)
    ask = [rocketkv(), "ask", "--cache", str(cache), "--max-new-tokens", str(max_new), "--json", "--quiet"]
    local_s, local_answers = [], []
    for i in range(n_local):
        seconds, done = timed([*ask, "--no-server", QUESTIONS[i % len(QUESTIONS)]], env)
        local_s.append(seconds)
        local_answers.append(json.loads(done.stdout)["answer"])
    socket = work / "serve.sock"
    proc = start_server(socket, env)
    try:
        timed([*ask, "--server", f"unix:{socket}", QUESTIONS[0]], env)  # loads the model and the cache
        server_s, server_answers, tokens = [], [], []
        for i in range(n_server):
            seconds, done = timed([*ask, "--server", f"unix:{socket}", QUESTIONS[i % len(QUESTIONS)]], env)
            record = json.loads(done.stdout)
            server_s.append(seconds)
            server_answers.append(record["answer"])
            tokens.append(record["n_answer_tokens"])
        ttft = [first_token_s(socket, cache, QUESTIONS[i % len(QUESTIONS)], max_new) for i in range(3)]
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    same = sum(a == b for a, b in zip(local_answers, server_answers))
    return {
        "preset": preset,
        "document": doc.name,
        "context_tokens": info.get("n_context_tokens") or info.get("context_tokens"),
        "max_new_tokens": max_new,
        "in_process_s": local_s,
        "server_s": server_s,
        "answer_tokens": tokens,
        "first_token_s": ttft,
        "identical_answers": f"{same}/{min(n_local, n_server)}",
        "threads": env.get("ROCKETKV_THREADS", "default"),
        "date": time.strftime("%Y-%m-%d"),
    }


def table(rows: list[dict]) -> str:
    head = ("| preset | questions (in-process / server) | in-process s/question | server s/question | speedup | "
            "answer tokens (mean) | first token s (median) | identical answers |\n"
            "|---|---|---|---|---|---|---|---|")  # fmt: skip
    lines = [head]
    for r in rows:
        local, served = statistics.mean(r["in_process_s"]), statistics.mean(r["server_s"])
        lines.append(f"| {r['preset']} | {len(r['in_process_s'])} / {len(r['server_s'])} | {local:.2f} | "
                     f"{served:.2f} | {local / served:.1f}× | {statistics.mean(r['answer_tokens']):.1f} | "
                     f"{statistics.median(r['first_token_s']):.3f} | {r['identical_answers']} |")  # fmt: skip
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", action="append", help="gemma-3-270m, smollm2-135m (repeatable; default both)")
    parser.add_argument("--doc", type=Path, default=REPO.parent / "shared" / "data" / "gpl-3.txt")
    parser.add_argument("--questions", type=int, default=100, help="asked through the server")
    parser.add_argument("--in-process", type=int, default=10, help="asked in fresh processes without a server")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/rocketkv-serve-loop"))
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "bench" / "serve-loop.json")
    parser.add_argument("--force", action="store_true", help="measure presets already in --out again")
    parser.add_argument("--smoke", action="store_true", help="SmolLM2, a 600-token slice, 3 questions (CI)")
    args = parser.parse_args()
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    presets = args.preset or ["gemma-3-270m", "smollm2-135m"]
    if args.smoke:
        args.workdir = args.workdir.with_name(args.workdir.name + "-smoke")
        shutil.rmtree(args.workdir, ignore_errors=True)
        args.workdir.mkdir(parents=True)
        slice_ = args.workdir / "slice.txt"
        slice_.write_text(re.sub(r"\s+", " ", args.doc.read_text())[:2500])
        args.doc, presets, args.questions, args.in_process, args.max_new_tokens = slice_, ["smollm2-135m"], 3, 1, 8
        args.out = args.workdir / "serve-loop.json"
    args.workdir.mkdir(parents=True, exist_ok=True)
    done = json.loads(args.out.read_text()) if args.out.exists() else {}
    for preset in presets:
        if preset in done and not args.force:
            print(f"{preset}: in {args.out} already (--force to measure again)", file=sys.stderr)
            continue
        done[preset] = run_preset(preset, args.doc, args.workdir, args.questions, args.in_process,
                                  args.max_new_tokens, env)  # fmt: skip
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(done, indent=1) + "\n")
    print(table([done[p] for p in presets if p in done]))
    if args.smoke:
        row = done[presets[0]]
        if row["identical_answers"] != "1/1":
            raise SystemExit(f"answers differ with and without the server: {row['identical_answers']}")


if __name__ == "__main__":
    main()
