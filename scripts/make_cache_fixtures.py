"""Add the `.kv` fixtures of the current format version to tests/data/, with the answers they must give.

The files are built from tiny random-init models (tests/conftest.py, fixed seeds, float32) and
kept in the repository, so that every later rocketkv must still read what an earlier one wrote:
tests/test_fixtures.py loads each file with the current code, answers the recorded questions and
compares the token ids with `tests/data/fixtures.json`. Answers use exact attention over the stored
cache, so they test the stored keys, values and positions, not stage-2 choices a later version may
improve. Files of older versions stay as they were written (v1 and v2 by rocketkv 0.1.0 before
the redesign): run this only when the format version changes. It builds each file below, names it
by the version it is written with (`version_for`: an int4+alloc file is v5, the others v4), and
writes only the files of the current version N (`v{N}-*.kv`) with their records, leaving every
other file and record alone. v4: a one-segment int8 file on a sliding-window model, a one-segment
int4 file with pre-RoPE keys on it, a segmented int4 file; v5: a one-segment int4+alloc file on
the sliding-window model.

    python scripts/make_cache_fixtures.py [--out tests/data]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from rocketkv_cli.eval.reports import read_json, write_json

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

    from rocketkv_cli.api.documents import TextPieces
    from rocketkv_cli.api.segments import ingest_stream
    from rocketkv_cli.core.config import PrefillConfig
    from rocketkv_cli.core.quant import KVStorage
    from rocketkv_cli.engine.answer import answer
    from rocketkv_cli.engine.inputs import Document
    from rocketkv_cli.store.format import FORMAT_VERSION, all_segments, load_cache, save_cache, version_for

    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "fixtures.json"
    record = read_json(path, {})
    cfg = PrefillConfig(token_budget=64, max_new_tokens=MAX_NEW_TOKENS, window_size=8, pool_kernel_size=7)
    made = {}
    engine = make_engine("gemma3_text", torch.float32)

    def named(suffix: str, cache):  # the file name carries the version the file is written with
        return f"v{version_for(cache.info.storage)}-{suffix}.kv"

    cache = engine.ingest(Document(document_text(120, 0), "0" * 64, "gemma3_text.txt"), cfg, storage=KVStorage("int8"))
    made[named("gemma3_text", cache)] = ("gemma3_text", engine, cache)
    cache = engine.ingest(Document(document_text(90, 1), "1" * 64, "rope.txt"), cfg,
                          storage=KVStorage.parse("int4+rope"))  # fmt: skip
    made[named("gemma3_text-rope", cache)] = ("gemma3_text", engine, cache)  # v4: pre-RoPE keys store the frequencies
    cache = engine.ingest(Document(document_text(100, 2), "2" * 64, "alloc.txt"), cfg,
                          storage=KVStorage.parse("int4+alloc"))  # fmt: skip
    made[named("gemma3_text-alloc", cache)] = ("gemma3_text", engine, cache)  # v5: allocated key bits
    engine = make_engine("llama", torch.float32)
    text = "".join(document_text(30 + 7 * i, i) for i in range(3))
    cache = ingest_stream(engine, TextPieces(text, "book.txt"), cfg, segment_tokens=200, storage=KVStorage("int4"))
    made[named("llama", cache)] = ("llama", engine, cache)
    for name, (arch, engine, cache) in made.items():
        if not name.startswith(f"v{FORMAT_VERSION}-"):
            continue  # an older version's file: kept as that version wrote it
        save_cache(cache, args.out / name, force=True)
        loaded = load_cache(args.out / name)
        parts = all_segments(loaded)
        record[name] = {"arch": arch, "segmented": len(parts) > 1, "answers": [
            [list(a.token_ids) for a in answer(engine, part, QUESTIONS, MAX_NEW_TOKENS, None)] for part in parts
        ]}  # fmt: skip
    write_json(args.out / "fixtures.json", record, end="\n")
    print(f"wrote {', '.join(record)} and fixtures.json in {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
