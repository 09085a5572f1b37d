"""Record what the installed CLI answers, for before/after comparisons of a refactor.

Runs `rocketkv ingest`, `ask --json`, `ask --dense`, `summarize --json` and `inspect --json` on a
fixed set of cases (tiny random-init models built from seeds, both presets on real documents, a
segmented document) and writes one JSON line per command with everything but the timings and
paths. Two runs of the same code give identical files; a refactor that changes no behaviour
must too:

    python scripts/answers_snapshot.py --out build/before.jsonl        # on the old commit
    python scripts/answers_snapshot.py --out build/after.jsonl         # on the new one
    diff build/before.jsonl build/after.jsonl && echo identical

`--rocketkv` picks the binary (default: the one beside this Python, else on PATH); `--quick` skips the real presets.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from rocketkv_cli.eval.reports import write_text

ROOT = Path(__file__).resolve().parents[1]
DATA = Path(os.environ.get("ROCKETKV_SHARED_DATA", ROOT.parent / "shared" / "data"))
VOLATILE = {
    "prefill_s",
    "decode_s",
    "summarize_s",
    "ingest_s",
    "created_at",
    "metadata_sha256",
    "cache",
    "source",
    "document_source",
    "file_bytes",
}  # paths (and so header sizes) differ between checkouts


def tiny_model_dir(arch: str, where: Path) -> Path:
    """A tiny random-init model of `arch` saved with the byte tokenizer (tests/conftest.py)."""
    target = where / f"tiny-{arch}"
    if (target / "config.json").exists():
        return target
    sys.path.insert(0, str(ROOT / "tests"))
    import torch
    from conftest import byte_tokenizer, tiny_model

    tiny_model(arch, torch.float32).save_pretrained(target)
    byte_tokenizer().save_pretrained(target)
    return target


def facts_text(n_words: int) -> str:
    words = "alpha river stone green seven cloud north paper light metal".split()
    body = " ".join(words[(i * 7 + i // 3) % len(words)] for i in range(n_words))
    return f"The lighthouse keeper's code is 4242.\n{body}\nThe ferry leaves at noon.\n"


def cases(tmp: Path, models: Path, quick: bool) -> list[tuple[str, list[str]]]:
    """(name, argv) per command; a name shared by ingest and its questions."""
    out: list[tuple[str, list[str]]] = []
    qs = ["What is the lighthouse keeper's code?", "When does the ferry leave?"]
    for arch in ("llama", "gemma3_text"):
        m = str(tiny_model_dir(arch, models))
        doc = tmp / f"{arch}.txt"
        doc.write_text(facts_text(160))
        kv = tmp / f"{arch}.kv"
        common = ["--model", m]
        out += [
            (
                f"{arch}-ingest",
                ["ingest", str(doc), "-o", str(kv), "--budget", "64", "--max-new-tokens", "8", "--json", *common],
            ),
            (f"{arch}-inspect", ["inspect", str(kv), "--json"]),
            (f"{arch}-ask", ["ask", "--cache", str(kv), *qs, "--json"]),
            (f"{arch}-dense", ["ask", "--cache", str(kv), qs[0], "--dense", "--json"]),
            (f"{arch}-summarize", ["summarize", "--cache", str(kv), "--max-new-tokens", "6", "--json"]),
            (f"{arch}-ask-doc", ["ask", str(doc), qs[1], "--budget", "48", "--max-new-tokens", "5", "--json", *common]),
        ]
    m = str(tiny_model_dir("llama", models))
    doc = tmp / "long.txt"
    doc.write_text("\n".join(facts_text(40 + 9 * i) for i in range(12)))
    kv = tmp / "long.kv"
    out += [
        (
            "seg-ingest",
            [
                "ingest",
                str(doc),
                "-o",
                str(kv),
                "--segment-tokens",
                "256",
                "--budget",
                "64",
                "--max-new-tokens",
                "8",
                "--json",
                "--model",
                m,
            ],
        ),
        ("seg-inspect", ["inspect", str(kv), "--json"]),
        ("seg-ask", ["ask", "--cache", str(kv), *qs, "--json"]),
        ("seg-ask-2", ["ask", "--cache", str(kv), qs[0], "--segments", "2", "--json"]),
        ("seg-ask-j", ["ask", "--cache", str(kv), qs[1], "--segment", "1", "--json"]),
        ("seg-summarize", ["summarize", "--cache", str(kv), "--max-new-tokens", "6", "--json"]),
    ]
    if quick:
        return out
    gpl = DATA / "gpl-3.txt"
    head = tmp / "gpl-head.txt"
    head.write_bytes(gpl.read_bytes()[:12000])
    real_qs = ["Can I charge a fee for distributing copies of the program?",
               "How many days after the notice does a licensee have to cure a violation?",
               "Who publishes this license?"]  # fmt: skip
    for name, preset, source in (("smollm2", "smollm2-135m", gpl), ("gemma", "gemma-3-270m", head)):
        kv = tmp / f"{name}.kv"
        out += [
            (f"{name}-ingest", ["ingest", str(source), "-o", str(kv), "--model", preset, "--json"]),
            (f"{name}-inspect", ["inspect", str(kv), "--json"]),
            (f"{name}-ask", ["ask", "--cache", str(kv), *real_qs, "--json", "--max-new-tokens", "32"]),
            (f"{name}-dense", ["ask", "--cache", str(kv), real_qs[0], "--dense", "--json", "--max-new-tokens", "24"]),
            (f"{name}-summarize", ["summarize", "--cache", str(kv), "--max-new-tokens", "40", "--json"]),
        ]
    book = tmp / "kjv-head.txt"
    book.write_bytes((DATA / "kjv.txt").read_bytes()[:40000])
    kv = tmp / "kjv.kv"
    out += [
        (
            "kjv-ingest",
            ["ingest", str(book), "-o", str(kv), "--model", "smollm2-135m", "--segment-tokens", "4096", "--json"],
        ),
        (
            "kjv-ask",
            [
                "ask",
                "--cache",
                str(kv),
                "Who was Abraham's son?",
                "What did God create in the beginning?",
                "--json",
                "--max-new-tokens",
                "24",
            ],
        ),
    ]
    return out


def scrub(row: object) -> object:
    if isinstance(row, dict):
        return {k: scrub(v) for k, v in row.items() if k not in VOLATILE}
    if isinstance(row, list):
        return [scrub(v) for v in row]
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    beside = Path(sys.executable).parent / "rocketkv"  # a virtual environment's, else the one on PATH
    ap.add_argument("--rocketkv", default=str(beside) if beside.exists() else shutil.which("rocketkv") or "rocketkv")
    ap.add_argument("--models", type=Path, default=ROOT / "build" / "snapshot-models")
    ap.add_argument("--quick", action="store_true", help="tiny models only (seconds, not minutes)")
    ap.add_argument("--smoke", action="store_true", help="one tiny model ingest, work beside --out (CI)")
    args = ap.parse_args()
    tmp = args.out.parent / "snapshot-work" if args.smoke else ROOT / "build" / "snapshot-work"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    args.models.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    rows = []
    for name, argv in cases(tmp, args.models, args.quick or args.smoke)[: 1 if args.smoke else None]:
        t0 = time.perf_counter()
        r = subprocess.run([args.rocketkv, *argv], capture_output=True, text=True, env=env)
        print(f"{name}: exit {r.returncode} in {time.perf_counter() - t0:.1f}s", file=sys.stderr)
        lines = [scrub(json.loads(x)) for x in r.stdout.splitlines() if x.strip()]
        rows.append({"case": name, "exit": r.returncode, "stdout": lines,
                     "error": [x for x in r.stderr.splitlines() if x.startswith("Error:")]})  # fmt: skip
    write_text(args.out, "".join(json.dumps(row, sort_keys=True) + "\n" for row in rows))
    print(f"wrote {args.out} ({len(rows)} commands)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
