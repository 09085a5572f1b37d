"""How much each storage type of the `.kv` file costs and keeps (`rocketkv bench --kv-dtypes`).

One exact prefill of a document is compressed once per storage type (`Engine.compress`, same
stage-1 selection), each cache written to a file and read back the way `ask` reads it, and
measured side by side: file bytes, bytes per document token, file size over the bfloat16 full KV
cache of the same document, and fidelity against the float32 cache of the same budget —
teacher-forced top-1 agreement (the float32 cache's greedy answer fed token by token; the share
of steps where this storage's greedy next token is the same) and mean KL(float32 ‖ this storage)
per answer token in nats, greedy-answer agreement (common
prefix over the longer answer), and the answers' scores on planted facts when the questions have
expected values.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from ..core.cache import CompressedKVCache, full_kv_bytes
from ..core.config import PrefillConfig
from ..core.quant import KVStorage
from ..engine.answer import answer, decode_config_for, prepare_questions
from ..engine.decoder import Decoder
from ..engine.engine import QUESTION_RESERVE_TOKENS, Engine
from ..engine.inputs import Document
from ..store.format import load_cache, save_cache
from .runner import match_fraction, token_agreement


@dataclass(frozen=True)
class Probe:
    """A question and the values a right answer contains (empty: no score, fidelity only)."""

    text: str
    expected: tuple[str, ...] = ()


def teacher_forced_log_probs(engine: Engine, cache: CompressedKVCache, ids: list[int], reference: tuple[int, ...],
                             sparse: bool = True) -> torch.Tensor:  # fmt: skip
    """Next-token log-probabilities `[len(reference), V]` float32 at each step when the reference
    answer is fed after the framed question `ids`; stage 2 applied at each step exactly as decode
    does."""
    decoder = Decoder(engine, cache, max(QUESTION_RESERVE_TOKENS, len(ids)) + len(reference) + 1,
                      decode_config_for(cache, sparse))  # fmt: skip
    rows = []
    with decoder.attention():
        logits = decoder.prefill(ids)
        for token in reference:
            rows.append(logits.reshape(-1).float().log_softmax(-1))
            logits = decoder.decode_one_token(token)
    return torch.stack(rows) if rows else torch.empty(0, 0)


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
    prefill = engine.prefill_for(tokens.ids, cfg)
    shape = engine.shape
    bf16_full = full_kv_bytes(len(tokens.ids), [s.sliding_window for s in shape.layers], shape.n_kv_heads,
                              shape.head_dim, 2)  # fmt: skip
    rows, reference, ref_log_probs = [], None, []
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
        prepared = prepare_questions(engine, loaded, [p.text for p in probes], max_new_tokens)
        if reference is None:
            reference = answers
            ref_log_probs = [teacher_forced_log_probs(engine, loaded, ids, ref.token_ids)
                             for (_, ids), ref in zip(prepared, reference)]  # fmt: skip
            row.update(top1_agreement=1.0, greedy_agreement=1.0, mean_kl=0.0)
        else:
            same = steps = 0
            kl = 0.0
            for (_, ids), ref, ref_lp in zip(prepared, reference, ref_log_probs):
                lp = teacher_forced_log_probs(engine, loaded, ids, ref.token_ids)
                same += int((lp.argmax(dim=-1) == torch.tensor(ref.token_ids)).sum()) if len(lp) else 0
                steps += len(ref.token_ids)
                kl += float((ref_lp.exp() * (ref_lp - lp)).sum()) if len(lp) else 0.0  # KL(float32 ‖ this)
            row["top1_agreement"] = same / max(1, steps)
            row["mean_kl"] = kl / max(1, steps)
            row["greedy_agreement"] = sum(token_agreement(r.token_ids, a.token_ids)
                                          for r, a in zip(reference, answers)) / len(answers)  # fmt: skip
        rows.append(row)
        path.unlink()
    return rows


def load_first_token_seconds(engine: Engine, document: Document, cfg: PrefillConfig, kv_dtypes: list[str],
                             question: str, workdir: Path, rounds: int = 5) -> dict[str, list[float]]:  # fmt: skip
    """Seconds from opening a `.kv` file to the first answer token, per storage type, measured
    side by side: one prefill compressed and saved once per storage, then `rounds` rounds that
    each time every file in turn (load and verify, model check, question prefill, one token).
    Returns {storage name: [seconds per round]}. Raises BudgetError as `Engine.ingest`."""
    tokens = engine.document_tokens(document)
    prefill = engine.prefill_for(tokens.ids, cfg)
    paths = {}
    for name in kv_dtypes:
        cache = engine.compress(prefill, cfg, document.sha256, document.source, storage=KVStorage.parse(name),
                                tokens=tokens)  # fmt: skip
        paths[name] = save_cache(cache, workdir / f"load-{name}.kv", force=True)
    times: dict[str, list[float]] = {name: [] for name in kv_dtypes}
    for _ in range(rounds + 1):  # the first round warms the page cache and the model; not kept
        for name, path in paths.items():
            t0 = time.perf_counter()
            loaded = load_cache(path)
            if not isinstance(loaded, CompressedKVCache):
                raise ValueError(f"{path}: a load measurement document fits one segment")
            engine.check(loaded, str(path))
            next(iter(answer(engine, loaded, [question], 1, decode_config_for(loaded))))
            times[name].append(time.perf_counter() - t0)
    for path in paths.values():
        path.unlink()
    return {name: t[1:] for name, t in times.items()}
