"""Which segment does a question go to? BM25 over stored token ids vs the question's queries
against the stored keys, on needles planted in a KJV slice (the evidence behind `segments.route`).

Usage:
    python scripts/routing_experiment.py --model smollm2-135m --lines 800 --segment-tokens 4096
Prints one line per needle (its segment, and that segment's rank under each score; 0 = routed
there) and the top-1 hit counts. The ingested cache is kept in --workdir for reruns.
"""

from __future__ import annotations

import argparse
import random
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
KJV = ROOT.parent / "shared" / "data" / "kjv.txt"
NAMES = ["Lisbon", "Nairobi", "Osaka", "Quito", "Tbilisi", "Hobart", "Reykjavik", "Accra", "Tallinn", "Lima"]


def main() -> None:
    from rocketkv_cli.api.segments import ingest_stream, lexical_scores, segment_scores
    from rocketkv_cli.core.config import PrefillConfig
    from rocketkv_cli.engine.documents import TextStream, tokenize
    from rocketkv_cli.engine.engine import Engine
    from rocketkv_cli.model.loading import load_model
    from rocketkv_cli.store.format import load_cache, save_segmented

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--lines", type=int, default=800, help="KJV lines in the haystack (~38 tokens each)")
    ap.add_argument("--segment-tokens", type=int, default=4096)
    ap.add_argument("--needles", type=int, default=8)
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/rocketkv-routing"))
    args = ap.parse_args()
    args.workdir.mkdir(parents=True, exist_ok=True)
    lines = KJV.read_text(encoding="utf-8-sig").splitlines(keepends=True)[1000 : 1000 + args.lines]
    rng = random.Random(0)
    needles = []
    for i, name in enumerate(NAMES[: args.needles]):
        number = rng.randint(100000, 999999)
        lines.insert(int((i + 0.5) / args.needles * len(lines)), f"The special magic number for {name} is {number}.\n")
        needles.append(name)
    doc = args.workdir / f"needles-{args.lines}.txt"
    doc.write_text("".join(lines))
    engine = Engine(load_model(args.model))
    kv = args.workdir / f"{args.model}-{args.lines}-{args.segment_tokens}.kv"
    if not kv.exists():
        stored = ingest_stream(engine, TextStream(str(doc)), PrefillConfig(), args.segment_tokens)
        save_segmented(stored.segments, stored.metadata, kv)
    stored = load_cache(kv)
    starts = [int(p.metadata["segment_start_token"]) for p in stored.segments]
    text = doc.read_text()
    hits = {"bm25": 0, "keys": 0}
    print(f"{args.model}: {len(stored.segments)} segments of up to {args.segment_tokens} tokens")
    for name in needles:
        offset = len(tokenize(engine.tokenizer, text[: text.index(f"for {name} is")], False))
        own = max(j for j, s in enumerate(starts) if s <= offset)
        question = f"What is the special magic number for {name}?"
        ranks = {}
        for label, scores in (("bm25", lexical_scores(engine, stored, question)),
                              ("keys", segment_scores(engine, stored, question))):  # fmt: skip
            ranks[label] = int((scores > scores[own]).sum())
            hits[label] += ranks[label] == 0
        print(f"  {name:<10} segment {own}: rank by bm25 {ranks['bm25']}, by keys {ranks['keys']}")
    print(f"top-1: bm25 {hits['bm25']}/{len(needles)}, keys {hits['keys']}/{len(needles)} "
          f"(chance {len(needles) / len(stored.segments):.1f}/{len(needles)})")  # fmt: skip


if __name__ == "__main__":
    main()
