"""How much each storage type of the `.kv` file costs and keeps (`rocketkv bench --kv-dtypes`).

One exact prefill of a document is compressed once per storage type (`Engine.compress`, same
stage-1 selection), each cache written to a file and read back the way `ask` reads it, and
measured side by side: file bytes, bytes per document token, file size over the bfloat16 full KV
cache of the same document, and fidelity against the float32 cache of the same budget —
teacher-forced top-1 agreement (the float32 cache's greedy answer fed token by token; the share
of steps where this storage's greedy next token is the same), greedy-answer agreement (common
prefix over the longer answer), and the answers' scores on planted facts when the questions have
expected values.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ..core.cache import CompressedKVCache, full_kv_bytes
from ..core.config import PrefillConfig
from ..core.quant import KVStorage
from ..engine.answer import answer, decode_config_for, prepare_questions
from ..engine.documents import Document
from ..engine.engine import QUESTION_RESERVE_TOKENS, Decoder, Engine
from ..store.format import load_cache, save_cache
from .runner import match_fraction, token_agreement


@dataclass(frozen=True)
class Probe:
    """A question and the values a right answer contains (empty: no score, fidelity only)."""

    text: str
    expected: tuple[str, ...] = ()


def teacher_forced_top1(engine: Engine, cache: CompressedKVCache, ids: list[int], reference: tuple[int, ...],
                        sparse: bool = True) -> tuple[int, int]:  # fmt: skip
    """(steps where the greedy next token equals the reference's, steps) when the reference answer
    is fed after the framed question `ids`; stage 2 applied at each step exactly as decode does."""
    if not reference:
        return 0, 0
    decoder = Decoder(engine, cache, max(QUESTION_RESERVE_TOKENS, len(ids)) + len(reference) + 1,
                      decode_config_for(cache, sparse))  # fmt: skip
    same = 0
    with decoder.attention():
        logits = decoder.prefill(ids)
        for token in reference:
            same += int(logits.argmax(dim=-1)) == token
            logits = decoder.decode_one_token(token)
    return same, len(reference)


def storage_rows(
    engine: Engine,
    document: Document,
    cfg: PrefillConfig,
    kv_dtypes: list[str],
    probes: list[Probe],
    workdir: Path,
    max_new_tokens: int = 32,
    log: Callable[[str], None] = lambda message: None,
) -> list[dict]:
    """One row per storage type (bytes, tokens, fractions in [0, 1]). The first row is float32,
    the reference of the others' fidelity. Raises BudgetError as `Engine.ingest`."""
    tokens = engine.document_tokens(document)
    prefill = engine.prefill(tokens.ids, cfg.window_size, cfg.observation == "probe", cfg.chunk_tokens,
                             reconstruct=cfg.observation == "reconstruct")  # fmt: skip
    shape = engine.shape
    bf16_full = full_kv_bytes(len(tokens.ids), [s.sliding_window for s in shape.layers], shape.n_kv_heads,
                              shape.head_dim, 2)  # fmt: skip
    rows, reference = [], None
    for kv_dtype in ["float32", *[d for d in kv_dtypes if d != "float32"]]:
        log(f"storage {kv_dtype}: compress, save, load, answer {len(probes)} questions")
        storage = KVStorage.parse(kv_dtype)
        t0 = time.perf_counter()
        cache = engine.compress(prefill, cfg, document.sha256, document.source, storage=storage, tokens=tokens)
        path = save_cache(cache, workdir / f"storage-{kv_dtype}.kv", force=True)
        loaded = load_cache(path)
        if not isinstance(loaded, CompressedKVCache):
            raise ValueError(f"{path}: a storage comparison document fits one segment")
        engine.check(loaded, str(path))
        io_s = time.perf_counter() - t0
        answers = list(answer(engine, loaded, [p.text for p in probes], max_new_tokens, decode_config_for(loaded)))
        row = {"kv_dtype": kv_dtype, "file_bytes": path.stat().st_size, "kv_bytes": loaded.kv_bytes,
               "bytes_per_token": path.stat().st_size / len(tokens.ids), "file_vs_bf16_full_kv":
               path.stat().st_size / bf16_full, "bf16_full_kv_bytes": bf16_full, "n_context_tokens": len(tokens.ids),
               "kept_tokens": loaded.max_kept_tokens, "compress_save_load_s": io_s,
               "answers": [a.text for a in answers], "token_ids": [list(a.token_ids) for a in answers]}  # fmt: skip
        scored = [(p, a) for p, a in zip(probes, answers) if p.expected]
        row["score"] = sum(match_fraction(a.text, p.expected) for p, a in scored) / len(scored) if scored else None
        if reference is None:
            reference = answers
            row.update(top1_agreement=1.0, greedy_agreement=1.0)
        else:
            prepared = prepare_questions(engine, loaded, [p.text for p in probes], max_new_tokens)
            counts = [teacher_forced_top1(engine, loaded, ids, ref.token_ids)
                      for (_, ids), ref in zip(prepared, reference)]  # fmt: skip
            row["top1_agreement"] = sum(c[0] for c in counts) / max(1, sum(c[1] for c in counts))
            row["greedy_agreement"] = sum(token_agreement(r.token_ids, a.token_ids)
                                          for r, a in zip(reference, answers)) / len(answers)  # fmt: skip
        rows.append(row)
        path.unlink()
    return rows
