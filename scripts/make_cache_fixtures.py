"""Add the `.kv` fixtures of the current format version to tests/data/, with the answers they must give.

The files are built from tiny random-init models (tests/conftest.py, fixed seeds, float32) and
kept in the repository, so that every later rocketkv must still read what an earlier one wrote:
tests/test_fixtures.py loads each file with the current code, answers the recorded questions and
compares the token ids with `tests/data/fixtures.json`. Answers use exact attention over the stored
cache, so they test the stored keys, values and positions, not stage-2 choices a later version may
improve. Files of older versions stay as they were written (v1 and v2 by rocketkv 0.1.0 before
the redesign): run this only when the format version changes, and it adds `v{N}-*.kv` for the
current version N (a one-segment int8 file on a sliding-window model, a one-segment int4 file with
pre-RoPE keys on it, a segmented int4 file)
and leaves the others and their records alone:

    python scripts/make_cache_fixtures.py [--out tests/data]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
QUESTIONS = ["What is the lighthouse keeper's code?", "When does the ferry leave?"]
MAX_NEW_TOKENS = 8


def document_text(n_words: int, seed: int) -> str:
    words = "alpha river stone green seven cloud north paper light metal".split()
    body = " ".join(words[(i * 7 + seed + i // 3) % len(words)] for i in range(n_words))
    return f"The lighthouse keeper's code is 4242.\n{body}\nThe ferry leaves at noon.\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=ROOT / "tests" / "data")
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT / "tests"))
    import torch
    from conftest import make_engine

    from rocketkv_cli.core.config import PrefillConfig
    from rocketkv_cli.core.quant import KVStorage
    from rocketkv_cli.engine.answer import answer
    from rocketkv_cli.engine.documents import Document, TextPieces
    from rocketkv_cli.engine.segments import ingest_stream
    from rocketkv_cli.store.format import FORMAT_VERSION, all_segments, load_cache, save_cache

    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "fixtures.json"
    record = json.loads(path.read_text()) if path.exists() else {}
    cfg = PrefillConfig(token_budget=64, max_new_tokens=MAX_NEW_TOKENS, window_size=8, pool_kernel_size=7)
    made = {}
    engine = make_engine("gemma3_text", torch.float32)
    made[f"v{FORMAT_VERSION}-gemma3_text.kv"] = (
        "gemma3_text",
        engine,
        engine.ingest(Document(document_text(120, 0), "0" * 64, "gemma3_text.txt"), cfg, storage=KVStorage("int8")),
    )
    made[f"v{FORMAT_VERSION}-gemma3_text-rope.kv"] = (  # from v4: pre-RoPE keys store the layer's frequencies
        "gemma3_text",
        engine,
        engine.ingest(Document(document_text(90, 1), "1" * 64, "rope.txt"), cfg, storage=KVStorage.parse("int4+rope")),
    )
    engine = make_engine("llama", torch.float32)
    text = "".join(document_text(30 + 7 * i, i) for i in range(3))
    made[f"v{FORMAT_VERSION}-llama.kv"] = (
        "llama",
        engine,
        ingest_stream(engine, TextPieces(text, "book.txt"), cfg, segment_tokens=200, storage=KVStorage("int4")),
    )
    for name, (arch, engine, cache) in made.items():
        save_cache(cache, args.out / name, force=True)
        loaded = load_cache(args.out / name)
        parts = all_segments(loaded)
        record[name] = {"arch": arch, "segmented": len(parts) > 1, "answers": [
            [list(a.token_ids) for a in answer(engine, part, QUESTIONS, MAX_NEW_TOKENS, None)] for part in parts
        ]}  # fmt: skip
    (args.out / "fixtures.json").write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {', '.join(record)} and fixtures.json in {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
