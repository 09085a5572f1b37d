"""Documents longer than the model's context: segmented ingest (checkpointed and resumable),
routing each question to the segments that hold its answer (hierarchical summaries over the
segments: `summaries.summarize`).

Design (README "How it works"): the document is cut at line ends into segments that each fit the
context; each segment is prefilled on its own at RoPE positions 0 … n_j−1 and pruned with
SnapKV++, so ingest time is linear in the document and memory is one segment's working set. A
question is routed to the segments that best match it (`route`: BM25 over each segment's words,
decoded from its stored token ids, with the question's queries against the stored keys as the fallback), then answered
over the top segments' kept KV (`merge_segments`). No argument parsing or printing here.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import re
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from itertools import chain

import torch

from ..core.cache import CacheInfo, CompressedKVCache, LayerKV, SegmentedKVCache, SegmentInfo
from ..core.config import PrefillConfig, resolve_budgets
from ..core.quant import KVStorage, resolved
from ..engine.answer import GREEDY, Answer, KeptAnswerer, Sampling, TextCallback, answer, decode_config_for
from ..engine.engine import Engine, TokenProgress
from ..engine.inputs import Document, tokenize
from ..errors import BudgetError, CacheFormatError, InputError, UsageError
from ..model.hf import empty_cache, forward_tokens, rocketkv_attention
from ..store.checkpoints import Checkpoints
from .citations import citer
from .documents import TextPieces, TextStream, segment_texts

SEGMENT_SLACK_TOKENS = 16  # joint tokenization of a segment may differ from the per-line count
MIN_SEGMENT_TEXT_TOKENS = 64


@dataclass(frozen=True)
class SegmentDone:
    """Progress event: segment `index` is prefilled (or was found checkpointed: `resumed`)."""

    index: int
    n_tokens: int  # framed tokens of this segment
    resumed: bool


def frame_tokens(engine: Engine) -> int:
    """Tokens the prompt framing puts before a document (BOS, instructions)."""
    return len(engine.document_ids(Document("", "", "")))


def segment_limit(engine: Engine, cfg: PrefillConfig, segment_tokens: int | None) -> int:
    """Framed tokens per segment: `segment_tokens`, or all the context fits (None).

    Raises BudgetError: more than the context fits, or too few for the framing.
    """
    limit = engine.context_limit(cfg.max_new_tokens)
    seg = segment_tokens or limit
    if seg > limit:
        raise BudgetError(
            f"--segment-tokens {seg} is more than this model's context fits ({limit})", f"use at most {limit}"
        )
    room = seg - frame_tokens(engine) - SEGMENT_SLACK_TOKENS
    if room < MIN_SEGMENT_TEXT_TOKENS:
        raise BudgetError(
            f"--segment-tokens {seg} leaves no room for text after the prompt framing ({max(room, 0)} tokens)",
            f"use at least {seg - room + MIN_SEGMENT_TEXT_TOKENS}",
        )
    return seg


def ingest_stream(
    engine: Engine,
    stream: TextStream | TextPieces,
    cfg: PrefillConfig,
    segment_tokens: int | None = None,
    checkpoints: Checkpoints | None = None,
    on_segment: Callable[[SegmentDone], None] = lambda event: None,
    progress: TokenProgress = lambda done, total: None,
    storage: KVStorage = KVStorage(),
) -> CompressedKVCache | SegmentedKVCache:
    """Prefill and prune a document of any length, read as a stream; keys/values held as `storage`.

    A document that fits one segment gives a `CompressedKVCache` exactly as `Engine.ingest` would.
    A longer one is cut into segments of ≤ `segment_tokens` framed tokens (see `segment_limit`),
    each prefilled at positions 0 … n_j−1 and pruned on its own; with `checkpoints`, each finished
    segment is saved (and read back lazily) so an interrupted ingest resumes where it stopped.
    `progress(done, total)` reports tokens prefilled so far and the estimated total (from the
    bytes read, for a file).
    Raises:
        InputError: the stream's errors, or an empty document. BudgetError: see `segment_limit`.
    """
    engine.check_storage(resolved(storage, engine.dtype_name))
    seg = segment_limit(engine, cfg, segment_tokens)
    frame = frame_tokens(engine)
    texts = segment_texts(engine.tokenizer, stream, seg - frame - SEGMENT_SLACK_TOKENS)
    first, second = next(texts, ""), next(texts, None)
    if second is None:
        stream.check_not_empty()
        return engine.ingest(Document(first, stream.sha256, stream.source), cfg, progress, storage)
    if checkpoints:
        checkpoints.claim()  # a second ingest into the same file is refused now, not after its prefill
    parts: list[CompressedKVCache] = []
    start = tokens_done = bytes_done = chars_done = lines_done = 0
    for index, text in enumerate(chain([first, second], texts)):
        tokens = engine.document_tokens(Document(text, "", ""), chars_done, lines_done + 1)
        ids = tokens.ids
        chars_done += len(text)
        lines_done += text.count("\n")
        bytes_done += len(text.encode("utf-8", "surrogatepass"))
        size = stream.total_bytes or 0

        def seg_progress(done: int, total: int, before: int = tokens_done, read: int = bytes_done) -> None:
            estimate = (before + total) * size / read if size > read else before + total
            progress(before + done, max(int(estimate), before + done))

        if len(ids) > seg:
            raise BudgetError(f"segment {index} tokenized to {len(ids)} tokens, over {seg}", "lower --segment-tokens")
        ids_sha = hashlib.sha256(torch.tensor(ids, dtype=torch.int64).numpy().tobytes()).hexdigest()
        where = SegmentInfo(index=index, start_token=start, ids_sha256=ids_sha)
        part = _checkpointed(engine, checkpoints, index, ids, cfg, ids_sha, stream.source, where, storage)
        resumed = part is not None
        if part is None:
            part = engine.ingest_tokens(tokens, cfg, ids_sha, stream.source, where, seg_progress, storage)
            if checkpoints:
                part = checkpoints.save(index, part)
        parts.append(part)
        on_segment(SegmentDone(index=index, n_tokens=len(ids), resumed=resumed))
        start += len(ids) - frame
        tokens_done += len(ids)
    stream.check_not_empty()  # a whitespace-only stdin longer than one segment
    info = parts[0].info.with_(segment=None, document_sha256=stream.sha256, created_at=None,
                               n_context_tokens=sum(p.n_context_tokens for p in parts))  # fmt: skip
    return SegmentedKVCache(info=info, segments=tuple(parts))


def _checkpointed(engine: Engine, checkpoints: Checkpoints | None, index: int, ids: list[int], cfg: PrefillConfig,
                  ids_sha: str, source: str, where: SegmentInfo,
                  storage: KVStorage) -> CompressedKVCache | None:  # fmt: skip
    """Segment `index` from the checkpoints when one was built exactly so; else None."""
    if checkpoints is None:
        return None
    n = len(ids)
    expected = CacheInfo(identity=engine.identity, dtype=engine.dtype_name, n_context_tokens=n, document_sha256=ids_sha,
                         document_source=source, config=cfg, budgets=resolve_budgets(cfg, n, engine.shape.head_dim),
                         pool_kernel_size=cfg.pool_kernel(n), segment=where,
                         storage=resolved(storage, engine.dtype_name), weights=engine.cache_weights)  # fmt: skip
    return checkpoints.load(index, expected)


@torch.inference_mode()
def question_queries(engine: Engine, question: str, position: int) -> dict[int, torch.Tensor]:
    """Queries of the question's own tokens (not the framing) in each full-attention layer.

    The framed question is run alone at RoPE positions starting at `position` (where it would
    follow a segment). Returns {layer index: `[1, H, T_q, D]` float32}.
    """
    before = len(tokenize(engine.tokenizer, engine.prompt.before_question, False))
    ids = engine.question_ids(question)
    n_q = len(tokenize(engine.tokenizer, engine.prompt.before_question + question, False))
    cache = empty_cache(engine.model, engine.shape, len(ids))
    positions = torch.arange(position, position + len(ids), device=engine.loaded.device)
    with rocketkv_attention(engine.model, cache, engine.shape, capture_from=position + before) as session:
        forward_tokens(engine.model, cache, engine.ids(ids), positions)
    span = max(1, n_q - before)
    return {i: torch.cat(q, dim=2)[:, :, :span] for i, q in session.captured.items()}


def segment_scores(engine: Engine, stored: SegmentedKVCache, question: str) -> torch.Tensor:
    """Relevance of each segment to `question`, `[N_segments]` float32 (higher = more relevant).

    Per full-attention layer, query head and question token: the largest attention logit over
    the segment's kept keys (the framing tokens, shared by all segments, are left out); each such
    maximum is standardised across segments (z-score) and the mean over layers, heads and tokens
    is the segment's score. A needle's key stands out in the heads that retrieve it.
    """
    shape = engine.shape
    position = max(p.n_context_tokens for p in stored.segments)
    queries = question_queries(engine, question, position)
    if not queries:  # every layer is a sliding-window layer: no signal, keep document order
        return torch.zeros(len(stored.segments))
    frame = frame_tokens(engine)
    group = shape.n_heads // shape.n_kv_heads
    per_segment = []
    for part in stored.segments:
        maxima = []
        with part.layers_for_now() as layers:  # read from the file when first used, released after
            for i, q in sorted(queries.items()):
                layer = layers[i]  # [1, Hkv, S, D], [1, Hkv, S] (on the CPU)
                k = layer.keys[0].to(q.device, torch.float32)
                pos = layer.positions.to(q.device)
                b, h, t, d = q.shape
                assert k.shape[0] * group == h and k.shape[2] == d, (q.shape, k.shape)
                logits = torch.einsum("kgtd,ksd->kgts", q[0].view(k.shape[0], group, t, d), k)  # [Hkv, G, T, S]
                logits = logits.masked_fill((pos[0] < frame)[:, None, None, :], float("-inf"))
                maxima.append(logits.amax(dim=-1).reshape(h, t))  # [H, T]
        per_segment.append(torch.stack(maxima))  # [L_full, H, T]
    m = torch.stack(per_segment).cpu()  # [N, L_full, H, T]
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    z = (m - m.mean(dim=0)) / (m.std(dim=0, unbiased=False) + 1e-6)
    return z.flatten(1).mean(dim=1)


BM25_K1, BM25_B = 1.2, 0.75  # Okapi BM25's usual constants
_WORD = re.compile(r"[^\W_]+")


def words(text: str) -> list[str]:
    """Lower-cased words (runs of letters and digits) of `text`: BM25's terms."""
    return [w.lower() for w in _WORD.findall(text)]


def bm25(texts: list[str], question: str) -> torch.Tensor:
    """Okapi BM25 of the question's words in each text, `[len(texts)]` float32 (zero when no word
    of the question occurs). Terms are whole words (`words`), so that a rare name split into
    common sub-word tokens still counts as rare. Formula:
    Σ_t idf(t) · tf·(k1+1) / (tf + k1·(1 − b + b·len/avg_len)), idf(t) = ln(1 + (N − df + ½)/(df + ½))
    (Robertson et al., "Okapi at TREC-3", 1994; the idf variant of Lucene).
    """
    terms = sorted(set(words(question)))
    if not terms or not texts:
        return torch.zeros(len(texts))
    tf, lengths = [], []
    for text in texts:
        counts = Counter(words(text))
        lengths.append(float(sum(counts.values())))
        tf.append([float(counts[t]) for t in terms])
    tf_m = torch.tensor(tf)  # [N, Q]
    n = tf_m.shape[0]
    df = (tf_m > 0).sum(dim=0).float()
    idf = torch.log(1 + (n - df + 0.5) / (df + 0.5))
    length = torch.tensor(lengths)
    norm = BM25_K1 * (1 - BM25_B + BM25_B * length / length.mean().clamp(min=1.0))
    return (idf * tf_m * (BM25_K1 + 1) / (tf_m + norm[:, None])).sum(dim=1)


def lexical_scores(engine: Engine, stored: SegmentedKVCache, question: str) -> torch.Tensor:
    """`bm25` of the question over each segment's text (decoded from its stored token ids),
    `[N_segments]` float32.

    Raises:
        CacheFormatError: a segment without token ids, or ids outside the tokenizer's vocabulary.
    """
    vocab = len(engine.tokenizer)
    texts = []
    for part in stored.segments:
        if part.token_ids is None:
            raise CacheFormatError("a segment of this cache has no token ids")
        ids = part.token_ids.tolist()
        if ids and max(ids) >= vocab:
            raise CacheFormatError(f"segment token ids exceed this tokenizer's {vocab} tokens")
        texts.append(engine.tokenizer.decode(ids, skip_special_tokens=True))
    return bm25(texts, question)


def route(engine: Engine, stored: SegmentedKVCache, question: str, n_segments: int) -> list[int]:
    """The `n_segments` segments most relevant to `question`, in document order.

    Ranked by `lexical_scores` (BM25 over the segments' words); when no word of the question
    occurs anywhere, by `segment_scores` (the question's queries against the stored keys).
    docs/long-documents.md compares the two on planted needles: BM25 finds the needle's segment
    far more often with these small models.
    """
    if n_segments < 1:
        raise UsageError(f"--segments must be at least 1, got {n_segments}")
    scores = lexical_scores(engine, stored, question)
    if float(scores.max()) <= 0.0:
        scores = segment_scores(engine, stored, question)
    top = torch.topk(scores, min(n_segments, scores.shape[0])).indices
    return sorted(int(i) for i in top)


def merge_segments(stored: SegmentedKVCache, indices: list[int]) -> CompressedKVCache:
    """One cache over the chosen segments, for answering (parallel context windows).

    Each segment keeps its own RoPE positions 0 … n_j−1 (keys are stored rotated, so moving them
    would need a re-rotation); their kept KV are concatenated along the sequence and the question
    follows at max n_j. The longest chosen segment is seen at the distances it had at ingest, a
    shorter one max n_j − n_j tokens further away (its sliding-window layers' tokens may fall out
    of the window). One index gives that segment's cache unchanged.
    Raises:
        InputError: an index out of range.
    """
    if not indices or any(not 0 <= j < len(stored.segments) for j in indices):
        wrong = ", ".join(str(j) for j in indices if not 0 <= j < len(stored.segments)) or "none"
        raise InputError(
            f"segment {wrong} out of range; this cache has segments 0-{len(stored.segments) - 1}",
            "`rocketkv inspect FILE.kv` lists them",
        )
    parts = [stored.segments[j] for j in indices]
    if len(parts) == 1:
        return parts[0]
    with contextlib.ExitStack() as reading:  # the parts' layers read for this leave memory after it
        layers = tuple(
            LayerKV(
                torch.cat([x.keys for x in layer], 2),
                torch.cat([x.values for x in layer], 2),
                torch.cat([x.positions for x in layer], 2),
            )
            for layer in zip(*(reading.enter_context(p.layers_for_now()) for p in parts))
        )  # each [1, Hkv, Σ S_j, D] / [1, Hkv, Σ S_j]
    first = parts[0].info
    # re-selection (a store budget) keeps k segments' worth of working set, ranked over the chosen
    # segments' stored tokens together (the first tokens and last W kept are the concatenation's)
    prompt_budget = sum(p.info.budgets.prompt_budget for p in parts)
    budgets = dataclasses.replace(first.budgets, prompt_budget=prompt_budget,
                                  capacity_budget=prompt_budget + first.config.max_new_tokens)  # fmt: skip
    info = first.with_(n_context_tokens=max(p.n_context_tokens for p in parts), segment=None, budgets=budgets)
    return CompressedKVCache(info=info, layers=layers)


def answer_segmented(
    engine: Engine,
    stored: SegmentedKVCache,
    questions: list[str],
    max_new_tokens: int,
    sparse: bool,
    overrides: dict[str, int | None],
    n_segments: int = 1,
    segment: int | None = None,
    log: Callable[[str], None] = lambda message: None,
    sampling: Sampling = GREEDY,
    on_text: TextCallback | None = None,
    cite: int = 0,
    kept: KeptAnswerer | None = None,
) -> Iterator[Answer]:
    """Answer each question from the segments it is routed to (`route`), or from `segment`.

    sampling, on_text, cite, kept: as `answer.answer` (citations need one segment per answer).

    Every question is routed and checked before any is answered (`log` names the segments).
    Raises:
        InputError: an empty question or a bad segment index. BudgetError: a question that does
        not fit. ValueError: overrides that make no valid stage-2 configuration.
    """
    from ..engine.answer import prepare_questions

    jobs = []
    for question in questions:
        chosen = [segment] if segment is not None else route(engine, stored, question, n_segments)
        jobs.append((question, chosen, merge_segments(stored, chosen)))
    for i, (question, _, part) in enumerate(jobs, 1):
        prepare_questions(engine, part, [question], max_new_tokens, numbered=(i, len(jobs)))
    decodes = [decode_config_for(part, sparse, **overrides) for _, _, part in jobs]

    def answers() -> Iterator[Answer]:
        for i, ((question, chosen, part), decode) in enumerate(zip(jobs, decodes)):
            which = f"question {i + 1}: " if len(jobs) > 1 else ""  # one question (a chat turn): no number
            log(f"{which}answering from segment{'s' * (len(chosen) > 1)} {', '.join(map(str, chosen))}")
            ans = next(
                answer(
                    engine,
                    part,
                    [question],
                    max_new_tokens,
                    decode,
                    sampling=sampling,
                    on_text=on_text,
                    cite=citer(engine.tokenizer, part, cite),
                    kept=kept if len(chosen) == 1 else None,
                )
            )  # a merged cache is built per question
            yield dataclasses.replace(ans, segments=tuple(chosen))

    return answers()
