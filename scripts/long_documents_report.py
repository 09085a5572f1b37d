"""Evidence for documents longer than the context (issue: huge documents) → docs/long-documents.md.

Per preset, through the installed CLI (every number comes from a real `rocketkv` subprocess):
1. a slice of ../shared/data/kjv.txt of about --tokens tokens, with needles ("The special magic
   number for NAME is NUMBER.") planted at 10%, 50% and 90% depth (--needles-per-depth each);
2. `rocketkv ingest` of it with default settings: time, file size, peak RSS (GNU time), segments;
3. `rocketkv ask --cache` with every needle question (routing, default settings): hit rate, next
   to the hit rate when the needle's own segment is given directly (`--segment J`);
4. `rocketkv summarize --cache` of the same cache: run time and the summary;
5. the whole book for --full-book-seconds, then SIGTERM (checkpoints kept, as with Ctrl-C):
   tokens/s and the projected total time.
6. `--ceiling` (on the results already in --json): the ceiling of the needle rows. Each segment
   holding a needle is cut from the same document exactly as `ingest` cuts it, then ingested on
   its own twice, with the day's default settings (the pruned cache a segmented file made that
   day holds for it) and with nothing pruned (`--budget` above its length, `--kv-dtype auto`), and every needle question is
   asked of both (the second with `--dense`: exact attention over the whole segment, i.e. full
   attention). The found rate of the first next to the second says how much of what the routed
   answers miss is lost to pruning, and how much this model misses even with the whole segment.

Usage:
    python scripts/long_documents_report.py                      # both presets, ~25-40 min on 2 cores
    python scripts/long_documents_report.py --from-json          # rewrite the page from the JSON
    python scripts/long_documents_report.py --presets smollm2-135m --tokens 20000 --full-book-seconds 0
    python scripts/long_documents_report.py --ceiling               # add step 6 to the JSON's results
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from rocketkv_cli.eval.reports import kept, read_json, read_text, report_timer, table, write_json, write_text

ROOT = Path(__file__).resolve().parents[1]
KJV = ROOT.parent / "shared" / "data" / "kjv.txt"
DEPTHS = (0.1, 0.5, 0.9)
NAMES = ["Lisbon", "Nairobi", "Osaka", "Quito", "Tbilisi", "Hobart", "Reykjavik", "Accra", "Tallinn", "Lima",
         "Perth", "Bergen", "Cusco", "Dakar", "Hanoi", "Kigali", "Malmo", "Oaxaca", "Porto", "Sapporo"]  # fmt: skip
ROCKETKV = str(Path(sys.executable).parent / "rocketkv")


def run(args: list[str], timeout: float | None = None, interrupt_after: float | None = None) -> dict:
    """Run `rocketkv ARGS` under GNU time; return stdout, stderr, seconds and peak RSS in bytes."""
    cmd = ["/usr/bin/time", "-f", "MAXRSS_KB %M", ROCKETKV, *args]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    lines: list[tuple[float, str]] = []  # stderr lines with the time they arrived (seconds from start)
    reader = threading.Thread(target=lambda: lines.extend((time.perf_counter() - t0, x) for x in proc.stderr))
    reader.start()
    try:
        out = proc.stdout.read() if interrupt_after is None else ""
        proc.wait(timeout=interrupt_after if interrupt_after is not None else timeout)
    except subprocess.TimeoutExpired:
        # SIGTERM (a background job may have SIGINT ignored) to rocketkv only: GNU time must live to report
        children = Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()
        for pid in children or [str(proc.pid)]:
            os.kill(int(pid), signal.SIGTERM)
        proc.wait(timeout=120)
    out += proc.stdout.read()
    reader.join()
    seconds = time.perf_counter() - t0
    err = "".join(x for _, x in lines)
    rss = re.findall(r"MAXRSS_KB (\d+)", err)
    return {"code": proc.returncode, "stdout": out, "stderr": err, "seconds": seconds, "lines": lines,
            "peak_rss_bytes": int(rss[-1]) * 1024 if rss else None}  # fmt: skip


def tokenizer_of(preset: str):
    from rocketkv_cli.model.loading import load_model

    return load_model(preset).tokenizer


def build_document(tok, n_tokens: int, per_depth: int, seed: int) -> tuple[str, list[dict]]:
    """A KJV slice of about `n_tokens` tokens with needles; returns (text, needles)."""
    lines = KJV.read_text(encoding="utf-8-sig").splitlines(keepends=True)
    counts = [len(ids) for ids in tok(lines[:60000], add_special_tokens=False)["input_ids"]]
    total, end = 0, 0
    while total < n_tokens and end < len(counts):
        total += counts[end]
        end += 1
    body = lines[:end]
    rng = random.Random(seed)
    names = rng.sample(NAMES, per_depth * len(DEPTHS))
    needles = []
    for d_i, depth in enumerate(DEPTHS):
        for k in range(per_depth):
            name = names[d_i * per_depth + k]
            needles.append({"name": name, "number": str(rng.randint(100000, 999999)), "depth": depth,
                            "at_depth": round(depth + 0.01 * k, 3)})  # fmt: skip
    for needle in sorted(needles, key=lambda n: -n["at_depth"]):  # insert from the end: indices stay valid
        body.insert(
            int(needle["at_depth"] * len(body)),
            f"The special magic number for {needle['name']} is {needle['number']}.\n",
        )
    text = "".join(body)
    for needle in needles:
        prefix = text[: text.index(f"for {needle['name']} is")]
        needle["token_offset"] = len(tok(prefix, add_special_tokens=False)["input_ids"])
        needle["question"] = f"What is the special magic number for {needle['name']}?"
    return text, needles


def own_segment(segments: list[dict], token_offset: int) -> int:
    return max(j for j, s in enumerate(segments) if s["start_token"] <= token_offset)


def preset_report(preset: str, args, work: Path) -> dict:
    tok = tokenizer_of(preset)
    text, needles = build_document(tok, args.tokens, args.needles_per_depth, args.seed)
    doc = work / f"{preset}-kjv-needles.txt"
    doc.write_text(text)
    kv = work / f"{preset}.kv"
    kv.unlink(missing_ok=True)
    seg_opt = ["--segment-tokens", str(args.segment_tokens)] if args.segment_tokens else []
    ing = run(["ingest", str(doc), "-o", str(kv), "-m", preset, "--json", *seg_opt])
    assert ing["code"] == 0, ing["stderr"][-2000:]
    row = json.loads(ing["stdout"])
    info = json.loads(run(["inspect", str(kv), "--json"])["stdout"])
    questions = work / f"{preset}-questions.txt"
    questions.write_text("".join(n["question"] + "\n" for n in needles))
    routed = run(["ask", "--cache", str(kv), "--questions-file", str(questions), "--json"])
    assert routed["code"] == 0, routed["stderr"][-2000:]
    for needle, line in zip(needles, routed["stdout"].splitlines()):
        ans = json.loads(line)
        needle.update(routed_answer=ans["answer"], routed_segments=ans["segments"],
                      routed_hit=needle["number"] in ans["answer"])  # fmt: skip
    for needle in needles:
        needle["own_segment"] = own_segment(info["segments"], needle["token_offset"])
        needle["routed_to_own"] = needle["own_segment"] in needle["routed_segments"]
    for seg in sorted({n["own_segment"] for n in needles}):
        group = [n for n in needles if n["own_segment"] == seg]
        qfile = work / f"{preset}-q{seg}.txt"
        qfile.write_text("".join(n["question"] + "\n" for n in group))
        direct = run(["ask", "--cache", str(kv), "--segment", str(seg), "--questions-file", str(qfile), "--json"])
        assert direct["code"] == 0, direct["stderr"][-2000:]
        for needle, line in zip(group, direct["stdout"].splitlines()):
            ans = json.loads(line)["answer"]
            needle.update(own_answer=ans, own_hit=needle["number"] in ans)
    summ = run(["summarize", "--cache", str(kv), "--json"])
    assert summ["code"] == 0, summ["stderr"][-2000:]
    summary = json.loads(summ["stdout"])
    result = {
        "preset": preset, "segment_tokens": args.segment_tokens, "document_tokens": info["n_context_tokens"],
        "n_segments": row["n_segments"],
        "ingest_s": ing["seconds"], "ingest_tokens_per_s": info["n_context_tokens"] / row["ingest_s"],
        "ingest_peak_rss_bytes": ing["peak_rss_bytes"], "file_bytes": row["file_bytes"],
        "full_kv_bytes": info["full_kv_bytes"], "needles": needles,
        "ask_s": routed["seconds"], "ask_peak_rss_bytes": routed["peak_rss_bytes"],
        "summarize_s": summ["seconds"], "summary": summary["summary"],
        "partial_summaries": summary.get("partial_summaries", []),
    }  # fmt: skip
    if args.full_book_seconds > 0:
        result["full_book"] = full_book(preset, tok, args.full_book_seconds, work)
    kv.unlink(missing_ok=True)
    return result


def segment_cuts(engine, text: str, segment_tokens: int | None) -> list[dict]:
    """The segments `rocketkv ingest` (default settings) cuts `text` into: [{"text", "start_token",
    "n_tokens"}] (start_token: offset of the first document token in the whole document's tokens,
    as `inspect` reports it; n_tokens: framed tokens of the segment's prefill)."""
    from rocketkv_cli.api.documents import segment_texts
    from rocketkv_cli.api.segments import SEGMENT_SLACK_TOKENS, frame_tokens, segment_limit
    from rocketkv_cli.core.config import PrefillConfig, with_preset_defaults
    from rocketkv_cli.engine.inputs import Document

    cfg = with_preset_defaults(PrefillConfig(), engine.loaded.model_id, ())
    frame = frame_tokens(engine)
    room = segment_limit(engine, cfg, segment_tokens) - frame - SEGMENT_SLACK_TOKENS
    cuts, start = [], 0
    for piece in segment_texts(engine.tokenizer, [text], room):
        n = len(engine.document_ids(Document(piece, "", "")))
        cuts.append({"text": piece, "start_token": start, "n_tokens": n})
        start += n - frame
    return cuts


def ceiling(result: dict, args, work: Path) -> dict:
    """Step 6 for one preset's result: each needle's own segment ingested alone, pruned with the
    defaults and unpruned; every needle question asked of both. Adds `seg_default_*` and `full_*`
    to each needle and returns the run's record (segments, seconds, the commands)."""
    from rocketkv_cli.api.rocketkv import RocketKV

    preset = result["preset"]
    engine = RocketKV.load(preset).engine  # its tokenizer rebuilds the document, its limits cut it
    text, needles = build_document(engine.tokenizer, args.tokens, args.needles_per_depth, args.seed)
    by_name = {n["name"]: n for n in result["needles"]}
    for n in needles:  # the same document as the measured one, or the ceiling means nothing
        measured = by_name.get(n["name"], {})
        if (measured.get("number"), measured.get("token_offset")) != (n["number"], n["token_offset"]):
            raise SystemExit(f"{preset}: --tokens/--needles-per-depth/--seed do not rebuild the measured document")
    cuts = segment_cuts(engine, text, result.get("segment_tokens"))
    del engine  # the ingests below run in their own processes
    if sum(c["n_tokens"] for c in cuts) != result["document_tokens"] or len(cuts) != result["n_segments"]:
        raise SystemExit(
            f"{preset}: the segments cut today ({len(cuts)}, {sum(c['n_tokens'] for c in cuts)} tokens) "
            f"are not the measured ones ({result['n_segments']}, {result['document_tokens']})"
        )
    segments = []
    for n in needles:
        if own_segment(cuts, n["token_offset"]) != by_name[n["name"]]["own_segment"]:
            raise SystemExit(f"{preset}: {n['name']}'s needle falls in another segment than the measured one")
    for j, cut in enumerate(cuts):
        group = [by_name[n["name"]] for n in needles if own_segment(cuts, n["token_offset"]) == j]
        if not group:
            continue
        doc = work / f"{preset}-seg{j}.txt"
        doc.write_text(cut["text"])
        qfile = work / f"{preset}-seg{j}-questions.txt"
        qfile.write_text("".join(n["question"] + "\n" for n in group))
        record = {"segment": j, "start_token": cut["start_token"], "n_tokens": cut["n_tokens"],
                  "needles": [n["name"] for n in group]}  # fmt: skip
        for kind, ingest_opts, ask_opts in (
            ("seg_default", [], []),
            ("full", ["--budget", str(10 * cut["n_tokens"]), "--kv-dtype", "auto", "--observation", "tail"],
             ["--dense"]),
        ):  # fmt: skip
            kv = work / f"{preset}-seg{j}-{kind}.kv"
            ing = run(["ingest", str(doc), "-o", str(kv), "-m", preset, "--force", "--json", *ingest_opts])
            if ing["code"] != 0:
                raise SystemExit(f"{preset} segment {j} ({kind}): ingest failed: {ing['stderr'][-2000:]}")
            row = json.loads(ing["stdout"])
            if row["n_context_tokens"] != cut["n_tokens"]:
                raise SystemExit(f"{preset} segment {j}: ingest made {row['n_context_tokens']} tokens, "
                                 f"the cut has {cut['n_tokens']}")  # fmt: skip
            asked = run(["ask", "--cache", str(kv), "--questions-file", str(qfile), "--json", *ask_opts])
            if asked["code"] != 0:
                raise SystemExit(f"{preset} segment {j} ({kind}): ask failed: {asked['stderr'][-2000:]}")
            for needle, line in zip(group, asked["stdout"].splitlines(), strict=True):
                ans = json.loads(line)["answer"]
                needle.update({f"{kind}_answer": ans, f"{kind}_hit": needle["number"] in ans})
            record[kind] = {"ingest_s": round(ing["seconds"], 1), "ask_s": round(asked["seconds"], 1),
                            "file_bytes": row["file_bytes"], "kept_tokens_per_layer": row["kept_tokens_per_layer"],
                            "command": " ".join(["rocketkv ingest SEGMENT.txt -m", preset, *ingest_opts]) + " && "
                            + " ".join(["rocketkv ask --cache SEGMENT.kv --questions-file Q", *ask_opts])}  # fmt: skip
            kv.unlink(missing_ok=True)
        segments.append(record)
    return {"segments": segments, "date": time.strftime("%Y-%m-%d")}


def full_book(preset: str, tok, seconds: float, work: Path) -> dict:
    """Ingest the whole book for `seconds`, then interrupt: tokens/s and the projected total."""
    total = sum(
        len(ids) for ids in tok(KJV.read_text(encoding="utf-8-sig").splitlines(), add_special_tokens=False)["input_ids"]
    )
    out = work / f"{preset}-kjv-full.kv"
    r = run(["ingest", str(KJV), "-o", str(out), "-m", preset], interrupt_after=seconds)
    shutil.rmtree(work / f".{out.name}.segments", ignore_errors=True)
    start = next(t for t, line in r["lines"] if "loaded " in line)  # prefill starts once the model is loaded
    done = [(t, int(m.group(1))) for t, line in r["lines"] if (m := re.search(r"prefilled \((\d+) tokens", line))]
    tokens = sum(n for _, n in done)
    rate = tokens / (done[-1][0] - start) if done else 0.0
    return {"book_tokens": total, "segments_done": len(done), "tokens_done": tokens, "seconds": r["seconds"],
            "tokens_per_s": rate, "projected_total_s": total / rate if rate else None,
            "peak_rss_bytes": r["peak_rss_bytes"], "exit_code": r["code"]}  # fmt: skip


def label(r: dict) -> str:
    seg = r.get("segment_tokens")
    return r["preset"] + (f", --segment-tokens {seg}" if seg else "")


def hit_rows(r: dict, keys: tuple[str, ...], depths: tuple) -> list[list[str]]:
    """Per depth (None: all needles) the needles found, for each key of `keys`: `[label, depth, k/n, ...]`."""
    rows = []
    for depth in depths:
        group = [n for n in r["needles"] if depth is None or n["depth"] == depth]
        hits = [f"{sum(bool(n.get(key)) for n in group)}/{len(group)}" for key in keys]
        rows.append([label(r), "all" if depth is None else f"{depth:.0%}", *hits])
    return rows


def render(results: list[dict], command: str | list[str], old: str = "") -> str:
    """The page from the results; its design notes and the prose of its sections are kept from the
    previous page `old`, as written."""
    commands = command if isinstance(command, list) else [command]
    out = ["# Documents longer than the context", "", *kept(old, "## Design", ("## Measurements",)),
           "## Measurements", "",
           "Generated by " + " and ".join(f"`{c}`" for c in commands) + " (numbers from `rocketkv` "
           "subprocesses on this machine, 2 CPU cores, the model computing in float32; the JSON with every answer is "
           "`docs/bench/long-documents.json`). The "
           "document is a slice of `../shared/data/kjv.txt` with needles (\"The special magic number "
           "for NAME is NUMBER.\") planted around 10%, 50% and 90% depth; one cache serves the "
           "needle questions and the summary.", "", "## Ingest, file size, memory", ""]  # fmt: skip
    out += table(["preset", "document tokens", "segments", "ingest", "tokens/s", "peak RSS", "file", "file / full KV"],
                 [[label(r), f"{r['document_tokens']:,}", r["n_segments"], f"{r['ingest_s']:.0f} s",
                   f"{r['ingest_tokens_per_s']:.0f}", f"{r['ingest_peak_rss_bytes'] / 2**20:.0f} MiB",
                   f"{r['file_bytes'] / 1e6:.0f} MB", f"{r['file_bytes'] / r['full_kv_bytes']:.2f}"] for r in results])  # fmt: skip
    checks = [c for r in results for c in r.get("memory_check", [])]
    if checks:
        out += ["", *kept(old, "Peak RSS of `ingest` with the final code", ("",)), ""]
        out += table(["preset", "document tokens", "segments", "peak RSS", "file"],
                     [[c["preset"], f"{c['document_tokens']:,}", c["n_segments"], f"{c['peak_rss_bytes'] / 2**20:.0f} MiB",
                       f"{c['file_bytes'] / 1e6:.0f} MB"] for c in checks])  # fmt: skip
    out += ["", "## Needles (default settings: `rocketkv ask --cache FILE QUESTION`)", ""]
    out += table(["preset", "depth", "found (routed)", "routed to the needle's segment", "found (own segment given)"],
                 [row for r in results for row in hit_rows(r, ("routed_hit", "routed_to_own", "own_hit"), (*DEPTHS, None))])  # fmt: skip
    ceilings = [r for r in results if r.get("ceiling")]
    if ceilings:
        out += ["", "## Ceiling: each needle's own segment, pruned and whole", "",
                *kept(old, "`python scripts/long_documents_report.py --ceiling`", ("",)), ""]  # fmt: skip
        out += table(["preset", "depth", "found (own segment given)", "found (default cache)", "found (full attention)"],
                     [row for r in ceilings for row in hit_rows(r, ("own_hit", "seg_default_hit", "full_hit"), (*DEPTHS, None))])  # fmt: skip
        out.append("")
        for r in ceilings:
            segs = r["ceiling"]["segments"]
            out.append(f"- {label(r)} ({r['ceiling']['date']}): segments "
                       + ", ".join(f"{g['segment']} ({g['n_tokens']:,} tokens: default ingest "
                                   f"{g['seg_default']['ingest_s']:.0f} s, unpruned {g['full']['ingest_s']:.0f} s)"
                                   for g in segs) + ".")  # fmt: skip
        for r in ceilings:
            full = [n for n in r["needles"] if n.get("full_hit")]
            kept_hits = sum(bool(n.get("seg_default_hit")) for n in full)
            extra = sum(bool(n.get("seg_default_hit")) and not n.get("full_hit") for n in r["needles"])
            out.append(f"- {r['preset']}: the default cache answers {kept_hits} of the {len(full)} needles full attention "
                       f"answers" + (f" (and {extra} it misses)" if extra else "") + ".")  # fmt: skip
        misses = [(r["preset"], n) for r in ceilings for n in r["needles"] if not n.get("full_hit")]
        if misses:
            out += ["", "What full attention answered where it missed (the model's own ceiling):", ""]
            out += [f"- {p}, {n['name']} ({n['number']}): {n.get('full_answer', '')[:120]!r}" for p, n in misses]
    out += ["", "## Summaries (`rocketkv summarize --cache FILE`)", ""]
    for r in results:
        out += [f"**{r['preset']}** ({len(r['partial_summaries'])} partial summaries, {r['summarize_s']:.0f} s):", "",
                "> " + r["summary"].replace("\n", "\n> "), ""]  # fmt: skip
    books = [(r, r["full_book"]) for r in results if r.get("full_book")]
    if books:
        out += ["## The whole book (`rocketkv ingest kjv.txt`, interrupted)", ""]
        out += table(["preset", "book tokens", "tokens done", "tokens/s", "projected total", "peak RSS so far"],
                     [[label(r), f"{b['book_tokens']:,}", f"{b['tokens_done']:,} in {b['segments_done']} segments",
                       f"{b['tokens_per_s']:.0f}", f"{b['projected_total_s'] / 60:.0f} min" if b["projected_total_s"] else "-",
                       f"{b['peak_rss_bytes'] / 2**20:.0f} MiB" if b["peak_rss_bytes"] else "-"] for r, b in books])  # fmt: skip
    return "\n".join(out) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--presets", default="gemma-3-270m,smollm2-135m")
    ap.add_argument("--tokens", type=int, default=120_000)
    ap.add_argument("--needles-per-depth", type=int, default=5)
    ap.add_argument("--full-book-seconds", type=float, default=180)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/rocketkv-long"))
    ap.add_argument("--json", type=Path, default=ROOT / "docs" / "bench" / "long-documents.json")
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "long-documents.md")
    ap.add_argument("--segment-tokens", type=int, default=None, help="ingest option (default: rocketkv's)")
    ap.add_argument("--append", action="store_true", help="add these results to those already in --json")
    ap.add_argument("--from-json", action="store_true", help="only rewrite the page from --json")
    ap.add_argument("--ceiling", action="store_true",
                    help="step 6 only, on the results in --json (their presets among --presets)")  # fmt: skip
    args = ap.parse_args()
    command = "python scripts/long_documents_report.py " + " ".join(sys.argv[1:])
    if args.from_json:
        data = read_json(args.json)
    elif args.ceiling:
        data = read_json(args.json)
        args.workdir.mkdir(parents=True, exist_ok=True)
        if command.strip() not in data["command"]:
            data["command"] = [*(data["command"] if isinstance(data["command"], list) else [data["command"]]),
                               command.strip()]  # fmt: skip
        for result in data["results"]:
            if result["preset"] not in args.presets.split(","):
                continue
            print(f"== {label(result)}: ceiling", file=sys.stderr, flush=True)
            result["ceiling"] = ceiling(result, args, args.workdir)
            write_json(args.json, data)  # after each preset: a crash keeps the rest
    else:
        args.workdir.mkdir(parents=True, exist_ok=True)
        old = read_json(args.json) if args.append else None
        commands = (old["command"] if isinstance(old["command"], list) else [old["command"]]) if old else []
        results = list(old["results"]) if old else []
        for preset in args.presets.split(","):
            print(f"== {preset}", file=sys.stderr, flush=True)
            results.append(preset_report(preset, args, args.workdir))
            data = {"command": commands + [command.strip()], "results": results}
            write_json(args.json, data)  # after each preset: a crash keeps the rest
    write_text(args.out, render(data["results"], data["command"], read_text(args.out)))
    print(args.out)


if __name__ == "__main__":
    with report_timer(Path(__file__).name):
        main()
