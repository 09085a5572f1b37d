"""A shell loop of `rocketkv ask` over one cache, with and without a warm `rocketkv serve`, side by
side in one run: what a user scripting questions waits for per question.

    python benchmarks/serve_loop.py                       # both presets, the GPL (8K tokens), 100 questions
    python benchmarks/serve_loop.py --smoke               # SmolLM2, tests/data/harbor.txt, 3 questions (CI)

Per preset: the document is ingested once (kept in --workdir, reused by a rerun), a server is
started on a socket in --workdir and warmed with one question, then question by question
(interleaved, so that a machine whose load changes slows every way alike):
1. a fresh `rocketkv ask --server unix:...` process (the client imports no torch), `--questions`;
2. the same question in a fresh `rocketkv ask --no-server` process, as today, for the first
   `--in-process` questions; greedy answers must be identical to the server's;
3. with `--llama-cpp PYTHON`, a fresh llama.cpp process that loads its state file of the same
   framed document and decodes as many tokens as rocketkv's answer had, `--llama-questions`.
The first-token latency is timed from the request to the first piece of text, with the client
library in this process. Each process's wall time is taken around `subprocess.run`. Results go
to --out as JSON (a preset already there is skipped unless --force, so an interrupted run
resumes) and print as a table.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from rocketkv_cli.eval.reports import read_json, table, write_json

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


class LlamaCpp:
    """llama.cpp's way on the same framed document: its state file saved once (`llamacpp_child.py`),
    then one fresh process per question that loads the model and the state file, evaluates the
    question and decodes as many tokens as rocketkv's answer to that question had."""

    def __init__(self, python: str, preset: str, doc: Path, work: Path, env: dict):
        from rocketkv_cli.api.rocketkv import RocketKV, configure
        from rocketkv_cli.api.threads import resolve_threads
        from rocketkv_cli.model.loading import gguf_path

        self.python, self.env = python, env
        configure(quiet=True, progress_bars=False)
        self.prompt = RocketKV.load(preset).engine.prompt
        self.gguf, self.threads = str(gguf_path(preset)), str(resolve_threads()[0])
        self.child = str(REPO / "rocketkv_cli" / "eval" / "llamacpp_child.py")
        framed = work / f"{preset}-llama-doc.txt"
        framed.write_text(self.prompt.document_text(doc.read_text(encoding="utf-8")), encoding="utf-8")
        self.question = work / "llama-question.txt"
        self.question.write_text(self.prompt.question_text(QUESTIONS[0]), encoding="utf-8")
        argv = [python, self.child, self.gguf, str(framed), str(self.question), str(work), self.threads, "1"]
        self.made = json.loads(timed(argv, env)[1].stdout.strip().splitlines()[-1])

    def ask(self, question: str, n_new: int) -> float:
        """Wall seconds of a fresh llama.cpp process answering `question` with `n_new` tokens."""
        self.question.write_text(self.prompt.question_text(question), encoding="utf-8")
        n_ctx = self.made["llama_cpp_n_ctx"] + n_new + 256  # room for a longer question than the first
        argv = [self.python, self.child, "answer", self.gguf, self.made["llama_cpp_state_file"], str(self.question),
                str(n_ctx), self.threads, str(n_new)]  # fmt: skip
        return timed(argv, self.env)[0]


def run_preset(preset: str, doc: Path, work: Path, args, env: dict) -> dict:
    """One preset's loops, interleaved question by question (server, in-process, llama.cpp), so that
    a machine whose load changes during the run slows the three alike."""
    cache = work / f"{preset}.kv"
    if not cache.exists():
        timed([rocketkv(), "ingest", str(doc), "-o", str(cache), "--model", preset, "--force", "--quiet"], env)
    info = json.loads(timed([rocketkv(), "inspect", str(cache), "--json"], env)[1].stdout)
    llama = LlamaCpp(args.llama_cpp, preset, doc, work, env) if args.llama_cpp else None
    ask = [rocketkv(), "ask", "--cache", str(cache), "--max-new-tokens", str(args.max_new_tokens), "--json", "--quiet"]
    socket = work / "serve.sock"
    proc = start_server(socket, env)
    row: dict = {"in_process_s": [], "server_s": [], "answer_tokens": [], "llama_cpp_s": []}
    same = 0
    try:
        timed([*ask, "--server", f"unix:{socket}", QUESTIONS[0]], env)  # loads the model and the cache
        for i in range(args.questions):
            question = QUESTIONS[i % len(QUESTIONS)]
            seconds, done = timed([*ask, "--server", f"unix:{socket}", question], env)
            record = json.loads(done.stdout)
            row["server_s"].append(seconds)
            row["answer_tokens"].append(record["n_answer_tokens"])
            if i < args.in_process:
                seconds, local = timed([*ask, "--no-server", question], env)
                row["in_process_s"].append(seconds)
                same += json.loads(local.stdout)["answer"] == record["answer"]
            if llama is not None and i < args.llama_questions:
                row["llama_cpp_s"].append(llama.ask(question, record["n_answer_tokens"]))
        ttft = [first_token_s(socket, cache, QUESTIONS[i % len(QUESTIONS)], args.max_new_tokens) for i in range(5)]
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    return {
        "preset": preset,
        "document": doc.name,
        "context_tokens": info.get("n_context_tokens"),
        "max_new_tokens": args.max_new_tokens,
        **row,
        "first_token_s": ttft,
        "identical_answers": f"{same}/{len(row['in_process_s'])}",
        "llama_cpp_state_file_bytes": llama.made["llama_cpp_state_file_bytes"] if llama else None,
        "threads": env.get("ROCKETKV_THREADS", "default"),
        "load_average_at_end": os.getloadavg(),
        "date": time.strftime("%Y-%m-%d %H:%M"),
    }


def summary(rows: list[dict]) -> str:
    """The markdown table of the presets' rows (docs/serve.md)."""
    head = ["preset", "questions (in-process / server / llama.cpp)", "in-process s/question", "server s/question",
            "speedup", "llama.cpp s/question", "server vs llama.cpp", "answer tokens (mean)", "first token s (median)",
            "identical answers"]  # fmt: skip
    cells = []
    for r in rows:
        local, served = statistics.mean(r["in_process_s"]), statistics.mean(r["server_s"])
        llama = statistics.mean(r["llama_cpp_s"]) if r.get("llama_cpp_s") else None
        counts = " / ".join(str(len(r.get(k) or [])) for k in ("in_process_s", "server_s", "llama_cpp_s"))
        cells.append([r["preset"], counts, f"{local:.2f}", f"{served:.2f}", f"{local / served:.1f}×",
                      "-" if llama is None else f"{llama:.2f}", "-" if llama is None else f"{llama / served:.2f}×",
                      f"{statistics.mean(r['answer_tokens']):.1f}", f"{statistics.median(r['first_token_s']):.3f}",
                      r["identical_answers"]])  # fmt: skip
    return "\n".join(table(head, cells))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", action="append", help="gemma-3-270m, smollm2-135m (repeatable; default both)")
    parser.add_argument("--doc", type=Path, default=REPO.parent / "shared" / "data" / "gpl-3.txt")
    parser.add_argument("--questions", type=int, default=100, help="asked through the server")
    parser.add_argument("--in-process", type=int, default=10, help="asked in fresh processes without a server")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/rocketkv-serve-loop"))
    parser.add_argument("--out", type=Path, help="default: docs/bench/serve-loop-{N-thread,default-threads}.json")
    parser.add_argument("--force", action="store_true", help="measure presets already in --out again")
    parser.add_argument("--smoke", action="store_true", help="SmolLM2, tests/data/harbor.txt, 3 questions (CI)")
    parser.add_argument("--llama-cpp", metavar="PYTHON",
                        help="a Python with llama-cpp-python: the same loop as fresh llama.cpp processes")  # fmt: skip
    parser.add_argument("--llama-questions", type=int, default=20, help="asked by fresh llama.cpp processes")
    args = parser.parse_args()
    threads = os.environ.get("ROCKETKV_THREADS")
    args.out = args.out or REPO / "docs" / "bench" / (
        f"serve-loop-{threads}-thread.json" if threads else "serve-loop-default-threads.json"
    )
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    presets = args.preset or ["gemma-3-270m", "smollm2-135m"]
    if args.smoke:  # a document the repository ships, so the smoke needs nothing beside it
        args.workdir = args.workdir.with_name(args.workdir.name + "-smoke")
        shutil.rmtree(args.workdir, ignore_errors=True)
        args.workdir.mkdir(parents=True)
        args.doc, presets, args.questions, args.in_process, args.max_new_tokens = (
            REPO / "tests" / "data" / "harbor.txt",
            ["smollm2-135m"],
            3,
            1,
            8,
        )
        args.out = args.workdir / "serve-loop.json"
        args.llama_cpp = None
        args.out = args.workdir / "serve-loop.json"
    args.workdir.mkdir(parents=True, exist_ok=True)
    done = read_json(args.out, {})
    for preset in presets:
        if preset in done and not args.force:
            print(f"{preset}: in {args.out} already (--force to measure again)", file=sys.stderr)
            continue
        done[preset] = run_preset(preset, args.doc, args.workdir, args, env)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        write_json(args.out, done, end="\n")
    print(summary([done[p] for p in presets if p in done]))
    if args.smoke:
        row = done[presets[0]]
        if row["identical_answers"] != "1/1":
            raise SystemExit(f"answers differ with and without the server: {row['identical_answers']}")


if __name__ == "__main__":
    main()
