"""The engine: a loaded model and the field's two verbs.

- `Engine.prefill(doc_ids, …)`: the document's exact prefill, in chunks (keys cached after RoPE,
  the observation window's queries captured), then `Engine.compress(prefill, cfg)`: stage 1 per
  full-attention layer through its stage-1 method (`rocketkv_cli.methods`). One prefill can be compressed for
  many configurations (eval); `Engine.ingest` is both for one.
- `Decoder(engine, cache, …)` (`decoder.py`): static buffers over one compressed cache (context +
  a preallocated per-question tail), with `prefill(question ids)` and `decode_one_token(token)` at
  explicit RoPE positions n, n+1, … and `reset()` back to the stored context.

No argument parsing or printing here; progress goes through callbacks.
"""

from __future__ import annotations

import math
import shlex
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property

import torch

from ..core.cache import CacheInfo, CompressedKVCache, LayerKV, ModelIdentity, SegmentInfo
from ..core.config import FLOAT_CACHE_WEIGHT_FORMATS, STORE_ALL, PrefillConfig, resolve_budgets
from ..core.quant import KVStorage, resolved
from ..core.stage1 import gather_tokens
from ..errors import BudgetError, CacheFormatError, InputError
from ..methods import LayerPrefill, method_for
from ..methods.layer_budgets import layer_budgets
from ..model.captured import CapturedStep
from ..model.hf import (
    ModelShape,
    Reconstruction,
    RocketCache,
    empty_cache,
    forward_tokens,
    model_shape,
    rocketkv_attention,
    rope_frequencies,
)
from ..model.linears import cpu_has_native_bf16
from ..model.loading import LoadedModel, chat_template_digest, model_digest, stop_token_ids, tokenizer_digest
from ..model.step import DecodeStep, decode_step_for
from ..model.templates import PromptFormat, prompt_format, read_prompt
from .inputs import Document, DocumentTokens, overflow_error, tokenize, tokenize_document

QUESTION_RESERVE_TOKENS = 256  # room kept for a question when checking a document against the context
TokenProgress = Callable[[int, int], None]  # (tokens done, tokens total)


@dataclass
class Prefill:
    """One exact prefill of a framed document of `n_context_tokens` tokens.

    layers: per decoder layer, a `LayerPrefill` (full attention: all keys, captured queries) or a
    `LayerKV` (sliding window: its last `sliding_window` tokens, what it keeps).
    query_energy: per decoder layer, E[q_c²] `[Hkv, D]` float32 of the captured document queries
        (after RoPE, averaged over the tokens and each KV head's GQA group): the weights of
        allocated key bits (`core.quant.allocate_key_bits`); None: not captured.
    """

    n_context_tokens: int
    layers: list[LayerPrefill | LayerKV]
    query_energy: list[torch.Tensor] | None = None


class Engine:
    """A loaded model plus what rocketkv derives from it once (shape, prompt format, identity)."""

    def __init__(self, loaded: LoadedModel, compile_step: bool = False):
        self.loaded = loaded
        self.model = loaded.model
        self.tokenizer = loaded.tokenizer
        self.shape: ModelShape = model_shape(loaded.model)
        self.prompt: PromptFormat = prompt_format(loaded.tokenizer)
        self.stop_ids = stop_token_ids(loaded.model, loaded.tokenizer)
        self.rope_freqs = rope_frequencies(loaded.model, self.shape.head_dim)  # per layer [D/2] or None
        # The decode step without transformers' per-call plumbing (model/step.py); None: model.forward.
        self.step: DecodeStep | CapturedStep | None = decode_step_for(loaded.model, self.shape)
        # compile_step: the step captured once (model/captured.py), where it applies; seconds to
        # compile at the first decode, then a faster step (docs/performance.md)
        if compile_step and self.step is not None:
            self.step = CapturedStep(self.step)
        # The dtype of a question's re-selected working set (its keys and values; `Decoder`):
        # bfloat16 where the decode linears are bfloat16 (`bf16` weights, each product's input
        # already rounded to it) on a CPU that multiplies bfloat16 natively, where exact decode
        # attention over it is faster and answers as over float32 (docs/performance.md, "A
        # bfloat16 working set"); None: the model's dtype. Settable (tests, benchmarks).
        self.working_set_dtype: torch.dtype | None = (
            torch.bfloat16 if loaded.weights == "bf16" and loaded.device.type == "cpu"
            and loaded.dtype == torch.float32 and cpu_has_native_bf16() else None
        )  # fmt: skip

    def check_storage(self, storage: KVStorage) -> None:
        """Refuse, before any prefill, a storage this model cannot hold as named: int4 or pre-RoPE
        keys with an odd head dim (codes and RoPE pairs need pairs), or pre-RoPE keys on a model
        whose rotary embedding rotates no layer's whole head (the file would claim a rotation that
        never happened). Raises InputError naming the storage and what to use instead."""
        d = self.shape.head_dim
        if d % 2 and (storage.bits == 4 or storage.rotation == "rope"):
            raise InputError(f"--kv-dtype {storage.name} needs an even head_dim; {self.loaded.model_id} has {d}",
                             "use int8 (without +rope)")  # fmt: skip
        if storage.rotation == "rope" and all(f is None for f in self.rope_freqs):
            raise InputError(
                f"--kv-dtype {storage.name}: {self.loaded.model_id} has no RoPE frequencies rocketkv can read "
                "for the whole head",
                f"use --kv-dtype {storage.kv_dtype} (without +rope)",
            )

    @cached_property
    def identity(self) -> ModelIdentity:
        """What a cache must match to be used with this model."""
        return ModelIdentity(
            model_id=self.loaded.model_id,
            model_digest=model_digest(self.model, self.loaded.weights_digest),
            tokenizer_digest=tokenizer_digest(self.tokenizer, list(self.loaded.tokenizer_files)),
            chat_template_digest=chat_template_digest(self.tokenizer),
            prompt_template_id=self.prompt.template_id,
            n_layers=len(self.shape.layers),
            n_kv_heads=self.shape.n_kv_heads,
            head_dim=self.shape.head_dim,
            layer_windows=tuple(s.sliding_window for s in self.shape.layers),
        )

    @property
    def cache_weights(self) -> str:
        """The weight format a cache built by this engine records: the one that computed its keys
        and values. `head-bf16`, `head-int4` and `mlp-bf16` prefill with the float model exactly
        (only decode steps differ), so their caches record `float`: they are float caches, readable
        by every release."""
        return "float" if self.loaded.weights in FLOAT_CACHE_WEIGHT_FORMATS else self.loaded.weights

    @property
    def dtype_name(self) -> str:
        return str(self.loaded.dtype).removeprefix("torch.")

    def ids(self, token_ids: list[int]) -> torch.Tensor:
        """`[1, T]` int64 on the model's device."""
        return torch.tensor([token_ids], dtype=torch.long, device=self.loaded.device)

    def document_ids(self, document: Document) -> list[int]:
        """Token ids of the framed document (template text before the document + the document)."""
        return tokenize(self.tokenizer, self.prompt.document_text(document.text), self.prompt.add_special_tokens)

    def document_tokens(self, document: Document, char_start: int = 0, line_start: int = 1) -> DocumentTokens:
        """`document_ids` with each token's character offset and line in the source document
        (`char_start`/`line_start`: where this text begins there, for a segment of a book)."""
        return tokenize_document(self.tokenizer, self.prompt.before_document, document.text,
                                 self.prompt.add_special_tokens, char_start, line_start)  # fmt: skip

    def question_ids(self, question: str) -> list[int]:
        """Token ids of the framed question (the rest of the template, the question, the answer cue)."""
        return tokenize(self.tokenizer, self.prompt.question_text(question), False)

    @cached_property
    def question_prefix(self) -> tuple[int, ...]:
        """The token ids every framed question starts with (the template's text between the
        document and the question): the common prefix of a few probe questions' ids. A `Decoder`
        prefills them once and keeps their keys and values for every question."""
        probes = [self.question_ids(q) for q in ("x", "What?", "1 2", "Who wrote it")]
        n = 0
        while all(len(p) > n for p in probes) and len({p[n] for p in probes}) == 1:
            n += 1
        return tuple(probes[0][:n])

    def context_limit(self, max_new_tokens: int) -> int:
        """Most framed document tokens one prefill may hold: the model's context minus room for a
        question (QUESTION_RESERVE_TOKENS) and the answer. Raises BudgetError when nothing is left."""
        limit = self.shape.max_context_tokens - max_new_tokens - QUESTION_RESERVE_TOKENS
        if limit < 1:
            raise BudgetError(
                f"max_new_tokens {max_new_tokens} leaves no room in this model's {self.shape.max_context_tokens}-token "
                "context", "lower --max-new-tokens",
            )  # fmt: skip
        return limit

    def check(self, cache: CompressedKVCache, path: str | None) -> None:
        """Refuse a cache built for another model, tokenizer, chat template, prompt or geometry.
        `path`: the file it was read from (None: a cache already opened, named as such).

        Raises:
            CacheFormatError naming the first mismatch and the command that rebuilds the file.
        """
        label = cache.info.identity.mismatch(self.identity)
        if label is not None:
            built = cache.info.identity.model_id
            if path is None:
                raise CacheFormatError(f"the cache was built for {label} (model {built}), not this one",
                                       f"answer from it with the model it was opened for ({built})")  # fmt: skip
            doc = shlex.quote(cache.info.document_source) if cache.info.document_source else "DOC"
            rebuild = (f"rebuild it with: rocketkv ingest {doc} -o {shlex.quote(str(path))} "
                       f"--model {self.loaded.model_id} --force")  # fmt: skip
            raise CacheFormatError(f"{path} was built for {label} (model {built}), not this one", rebuild)

    # -- verb 1: prefill -------------------------------------------------------------------------

    def prefill(
        self,
        doc_ids: list[int],
        window_tokens: int,
        probe: bool = False,
        chunk_tokens: int = 1024,
        progress: TokenProgress = lambda done, total: None,
        reconstruct: bool = False,
    ) -> Prefill:
        """Exact prefill of framed document ids `doc_ids` at RoPE positions 0 … n−1, in chunks.

        window_tokens: queries of the last this many document tokens are captured per
        full-attention layer (the widest observation window any later compression needs). probe:
        also prefill the probe text (`prompts/probe.txt`) after the document; its queries are
        captured and its keys kept apart from the document's. reconstruct: also score the
        document's keys by context reconstruction (`reconstruction_scores`; the prefill is then
        the first half of `progress`, the reconstruction the second). The caller checks
        `doc_ids` against `context_limit`.
        """
        n, shape = len(doc_ids), self.shape
        probe_ids = self.question_ids(read_prompt("probe.txt")) if probe else []
        capture_from = max(0, n - window_tokens)
        # room after the document: the probe, or one re-read chunk (request + at most chunk_tokens)
        request = len(self.question_ids(read_prompt("reconstruct.txt"))) if reconstruct else 0
        extra = max(len(probe_ids), request + chunk_tokens if reconstruct else 0)
        cache = empty_cache(self.model, shape, n + extra)
        first_pass, second_pass = progress, progress
        if reconstruct:  # two passes over the document: each is half of the progress, in document tokens
            first_pass = lambda done, total: progress(done // 2, total)  # noqa: E731
            second_pass = lambda done, total: progress((total + done) // 2, total)  # noqa: E731
        with rocketkv_attention(self.model, cache, shape, capture_from=capture_from, capture_sliding=True) as session:
            self._prefill_chunks(cache, doc_ids, 0, chunk_tokens, first_pass)
            sliding = {i: _last_tokens(cache.layers[i].view(), s.sliding_window)
                       for i, s in enumerate(shape.layers) if s.sliding_window}  # fmt: skip
            recon = self.reconstruction_scores(cache, doc_ids, chunk_tokens, second_pass) if reconstruct else {}
            if probe_ids:
                self._prefill_chunks(cache, probe_ids, n, chunk_tokens, lambda d, t: None)
        layers: list[LayerPrefill | LayerKV] = []
        energy = []
        for i, spec in enumerate(shape.layers):
            document = torch.cat(session.captured[i], dim=2)[:, :, : n - capture_from]  # [1, H, W, D]
            grouped = document.reshape(shape.n_kv_heads, -1, document.shape[-1])  # [Hkv, G·W, D]: heads are kv-major
            energy.append((grouped**2).mean(1))  # [Hkv, D]
            if spec.sliding_window is not None:
                layers.append(sliding[i])
                continue
            keys, values, positions = cache.layers[i].view()  # [1, Hkv, n + probe, D]
            queries = torch.cat(session.captured[i], dim=2)  # [1, H, n + probe - capture_from, D]
            assert queries.shape[2] == n + len(probe_ids) - capture_from, (queries.shape, n, capture_from)
            layers.append(LayerPrefill(keys, values, positions, queries, n, len(probe_ids), capture_from, spec.scaling,
                                       spec.softcap, recon.get(i)))  # fmt: skip
        return Prefill(n_context_tokens=n, layers=layers, query_energy=energy)

    def reconstruction_scores(
        self, cache: RocketCache, doc_ids: list[int], chunk_tokens: int, progress: TokenProgress
    ) -> dict[int, torch.Tensor]:
        """Context reconstruction (KVzip §3, our own implementation): how much the model needs each
        document key to repeat the document. For each chunk of `doc_ids`, the request
        `prompts/reconstruct.txt` (framed as a question) plus the chunk is run teacher-forced after
        the document's cache at positions n, n+1, …; each document key's score is the largest
        attention weight any of the chunk's queries gives it (softmax over all keys the query
        sees), summed over the query heads of its GQA group. The appended tokens are then dropped,
        so each chunk attends the document plus the request and itself; chunks are shortened so
        that the re-read stays within the model's positions. Measured cost: 2.75× the tail
        window's ingest time on SmolLM2, 2.5× on Gemma 3 270M (docs/performance.md, "Ingest").

        Returns: {full-attention layer index: `[1, Hkv, n]` float32}, n = len(doc_ids).
        Raises:
            BudgetError: the document leaves no room in the context for the re-read.
        """
        n, shape = len(doc_ids), self.shape
        request = self.question_ids(read_prompt("reconstruct.txt"))
        room = shape.max_context_tokens - n - len(request)  # the re-read stays within the model's positions
        if room < 1:
            raise BudgetError(
                f"document is {n} tokens: no room is left in the {shape.max_context_tokens}-token context to re-read "
                "it for context reconstruction", "use --observation tail, or smaller --segment-tokens",
            )  # fmt: skip
        chunk_tokens = min(chunk_tokens, room)
        record = Reconstruction(n_context=n, score_from=n + len(request))
        for offset in range(0, n, chunk_tokens):
            piece = request + doc_ids[offset : offset + chunk_tokens]
            lengths = [layer.length for layer in cache.layers]
            positions = torch.arange(n, n + len(piece), device=self.loaded.device)
            with rocketkv_attention(self.model, cache, shape, reconstruct=record):
                forward_tokens(self.model, cache, self.ids(piece), positions)
            for layer, length in zip(cache.layers, lengths):
                layer.length = length  # drop the request and the chunk
            progress(min(n, offset + chunk_tokens), n)
        group = shape.n_heads // shape.n_kv_heads
        return {i: w.view(1, shape.n_kv_heads, group, n).sum(dim=2) for i, w in record.best.items()}

    def _prefill_chunks(
        self, cache: RocketCache, ids: list[int], start: int, chunk: int, progress: TokenProgress
    ) -> None:
        progress(0, len(ids))  # the total is known now: a progress bar shows it before the first chunk's seconds
        for offset in range(0, len(ids), chunk):
            piece = ids[offset : offset + chunk]
            positions = torch.arange(start + offset, start + offset + len(piece), device=self.loaded.device)
            forward_tokens(self.model, cache, self.ids(piece), positions)
            for layer, spec in zip(cache.layers, self.shape.layers):
                if spec.sliding_window is not None:
                    layer.keep_last(spec.sliding_window)
            progress(offset + len(piece), len(ids))

    def compress(
        self,
        prefill: Prefill,
        cfg: PrefillConfig,
        document_sha256: str,
        document_source: str,
        segment: SegmentInfo | None = None,
        storage: KVStorage = KVStorage(),
        tokens: DocumentTokens | None = None,
    ) -> CompressedKVCache:
        """Stage 1 over one prefill: each full-attention layer keeps `prompt_budget` tokens per KV
        head (more with `cfg.store_budget`: each question then re-selects its working set, see
        `Decoder`; all when the document is shorter) chosen by `cfg`'s stage-1 method
        (`rocketkv_cli.methods`); sliding-window layers keep their window (RocketKV §3.2;
        docs/algorithm.md). The kept keys/values are then held as `storage` stores them (`auto`:
        as computed), so a cache in memory answers exactly as the
        same cache read back from its file. `tokens`: the document's token ids and offsets, kept
        with the cache.

        Raises:
            BudgetError: the prompt budget falls below the observation window. `PrefillConfig`
                refuses a SnapKV++ token budget below the window before any model loads, and
                `derive_budgets` keeps at least min(n, t) tokens, so this guards only explicit or
                baseline configurations.
            ValueError: a storage the model's head dim does not allow (int4 with an odd one).
        """
        n = prefill.n_context_tokens
        budgets = resolve_budgets(cfg, n, self.shape.head_dim)
        if n > budgets.prompt_budget and budgets.prompt_budget < cfg.window_size:
            raise BudgetError(
                f"token budget {cfg.token_budget} with max_new_tokens {cfg.max_new_tokens} leaves a prompt budget of "
                f"{budgets.prompt_budget} tokens, below the observation window ({cfg.window_size})",
                "raise --budget or lower --max-new-tokens",
            )
        for layer in prefill.layers:  # a cache of inf or NaN would be written, then refused when read
            # one float32 sum each (inf and NaN survive it; no mask the size of the layer)
            if not all(math.isfinite(float(t.sum(dtype=torch.float32))) for t in (layer.keys, layer.values)):
                raise overflow_error(self.dtype_name)
        method = method_for(cfg)
        n_stored = cfg.stored_tokens(n, budgets.prompt_budget)  # the file's tokens per KV head (≥ the working set)
        stored_per_layer = layer_budgets(prefill.layers, cfg, method, n_stored)  # {layer index: tokens per KV head}
        storage = resolved(storage, self.dtype_name)
        layers = []
        for i, layer in enumerate(prefill.layers):
            weights = prefill.query_energy[i] if prefill.query_energy is not None else None  # [Hkv, D]
            if isinstance(layer, LayerKV):
                layers.append(layer.to_storage(storage, self.rope_freqs[i], weights))
                continue
            tensors = (layer.keys[:, :, :n], layer.values[:, :, :n], layer.positions[:, :, :n])
            if n <= n_stored:
                k, v, p = (t.contiguous() for t in tensors)
                layers.append(LayerKV(k, v, p).to_storage(storage, self.rope_freqs[i], weights))
                continue
            kept = method.select(layer, stored_per_layer.get(i, n_stored))  # [1, Hkv, that layer's count]
            k, v, p = (gather_tokens(t, kept) for t in tensors)
            layers.append(LayerKV(k, v, p).to_storage(storage, self.rope_freqs[i], weights))
        info = CacheInfo(
            identity=self.identity, dtype=self.dtype_name, n_context_tokens=n, document_sha256=document_sha256,
            document_source=document_source, config=cfg, budgets=budgets, pool_kernel_size=cfg.pool_kernel(n),
            segment=segment, storage=storage, weights=self.cache_weights,
        )  # fmt: skip
        if tokens is None:
            return CompressedKVCache(info, tuple(layers))
        ids = torch.tensor(tokens.ids, dtype=torch.int32)
        offsets, lines = _tensor_or_none(tokens.offsets, torch.int64), _tensor_or_none(tokens.lines, torch.int32)
        return CompressedKVCache(info, tuple(layers), ids, offsets, lines)

    def prefill_for(self, ids: list[int], cfg: PrefillConfig, progress: TokenProgress = lambda d, t: None) -> Prefill:
        """`prefill` of framed document `ids` with what `cfg`'s stage-1 method needs captured
        (its `capture`: the probe text's queries, or the re-reading pass), in `cfg.chunk_tokens` chunks;
        nothing extra when the file stores every token (`store_budget` "all": nothing is scored).

        Raises:
            ValueError: `cfg` names no registered stage-1 method (`methods.method_class`).
        """
        capture = None if cfg.store_budget == STORE_ALL else method_for(cfg).capture
        return self.prefill(ids, cfg.window_size, capture == "probe", cfg.chunk_tokens, progress,
                            capture == "reconstruct")  # fmt: skip

    def ingest_tokens(
        self,
        tokens: DocumentTokens,
        cfg: PrefillConfig,
        document_sha256: str,
        document_source: str,
        segment: SegmentInfo | None = None,
        progress: TokenProgress = lambda done, total: None,
        storage: KVStorage = KVStorage(),
    ) -> CompressedKVCache:
        """`prefill_for` then `compress` for one configuration. Raises BudgetError as `compress`,
        ValueError as `prefill_for`."""
        prefill = self.prefill_for(tokens.ids, cfg, progress)
        return self.compress(prefill, cfg, document_sha256, document_source, segment, storage, tokens)

    def ingest(
        self,
        document: Document,
        cfg: PrefillConfig,
        progress: TokenProgress = lambda done, total: None,
        storage: KVStorage = KVStorage(),
    ) -> CompressedKVCache:
        """Prefill and prune a document that fits the context (RocketKV §3.2).

        Raises:
            BudgetError: the document (plus room for a question and the answer) exceeds the
                context, or the prompt budget falls below the observation window.
        """
        tokens = self.document_tokens(document)
        limit = self.context_limit(cfg.max_new_tokens)
        if len(tokens.ids) > limit:
            raise BudgetError(
                f"document is {len(tokens.ids)} tokens; this model's context fits {limit} "
                "(after room for a question and answer)",
                "ingest it in segments: rocketkv ingest DOC (documents longer than the context are segmented)",
            )
        return self.ingest_tokens(tokens, cfg, document.sha256, document.source, progress=progress, storage=storage)


def _tensor_or_none(values: list[int] | None, dtype: torch.dtype) -> torch.Tensor | None:
    return None if values is None else torch.tensor(values, dtype=dtype)


def _last_tokens(kv: tuple[torch.Tensor, torch.Tensor, torch.Tensor], n_tokens: int) -> LayerKV:
    """A copy of the last `n_tokens` of a layer's keys, values `[1, Hkv, S, D]` and positions."""
    keep = min(n_tokens, kv[0].shape[2])
    k, v, p = (t[:, :, -keep:].clone() for t in kv)
    return LayerKV(k, v, p)
