"""The Python API: load a model once, ingest documents, open `.kv` files, answer, summarize.

    from rocketkv_cli import RocketKV

    rk = RocketKV.load("smollm2-135m")                  # a preset, a model dir, a .gguf, a cached hub id
    rk.ingest("contract.txt", output="contract.kv", token_budget=512)
    cache = rk.open("contract.kv")
    for answer in rk.ask(cache, ["Who are the parties?", "When does it end?"]):
        print(answer.text, answer.to_dict(cache="contract.kv"))
    print(rk.summarize(cache).text)

The CLI is a thin layer over this class (it parses, prints and maps errors). Every method raises
`rocketkv_cli.errors.RocketKVError` subclasses for known failures (one line each).
"""

from __future__ import annotations

import atexit
import dataclasses
import operator
import os
import shutil
import time
import weakref
from collections.abc import Callable, Generator, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from ..core.cache import AnyCache, CompressedKVCache, SegmentedKVCache
from ..core.config import (
    DEFAULT_MAX_NEW_TOKENS,
    AttentionChoice,
    PrefillConfig,
    default_kv_dtype,
    kernels_choice,
    preset_config,
    summary_writing,
)
from ..core.quant import KVStorage
from ..engine.answer import Answer, KeptAnswerer, Sampling, TextCallback, answer, decode_config_for, hsa_min_tokens
from ..engine.decoder import question_progress as question_progress
from ..engine.engine import Engine, TokenProgress
from ..errors import InputError, UsageError
from ..model.loading import DEFAULT_MODEL, PRESETS, load_model
from ..model.resolve import resolve_device, resolve_dtype
from ..store.checkpoints import Checkpoints
from ..store.describe import kept_tokens_per_layer as kept_tokens_per_layer
from ..store.folders import make_scratch_dir
from ..store.format import save_cache, verify_file
from ..store.metadata import all_segments
from ..store.prepared import PreparedTensors
from .checks import (
    check_cite,
    check_decode_options,
    check_model_choice,
    check_questions,
    check_segment,
    describe,
    read_cache,
)
from .checks import configure as configure
from .checks import decode_weights_for as decode_weights_for
from .checks import pending_checkpoints as pending_checkpoints
from .citations import Citation, citer
from .documents import TextPieces, TextStream
from .focus import (
    FOCUS_PASSAGES,
    Passage,
    QuestionAttention,
    check_ranking,
    focus_text,
    source_passages,
    stored_passages,
)
from .focus import ranked as focus_ranked
from .home import StoredModel, home, remove_models, stored_models
from .preflight import abandoned_ingests, check_cache_file, check_output, default_output, open_document
from .segments import SegmentDone, answer_segmented, ingest_stream
from .session import AnswerStream, Session
from .summaries import PartialSummary, Summary, extractable, summarize
from .threads import apply as apply_threads
from .threads import default_threads, requested_threads

Log = Callable[[str], None]


@dataclass(frozen=True)
class Focused:
    """What `RocketKV.ask_focused` answered: the answer and the passages it was answered from
    (of the text decoded from the cache, `focus.Passage`; empty: no passage shares a word with the
    question, so the whole cache answered), and the same passages as `Citation`s of the source
    (characters and lines; empty for a cache without token offsets, an old file)."""

    answer: Answer | None  # None only in `on_chosen`, before it is decoded
    passages: tuple[Passage, ...]
    sources: tuple[Citation, ...] = ()  # the passages in the source's characters and lines (a cache with offsets)

    def note(self) -> str:
        """One line naming what the answer is read from ("focus: answered from lines 12-14, 80"),
        as `ask --focus` writes it on stderr before the answer."""
        if not self.passages:
            return "focus: no passage shares a word with the question; answered from the whole document"
        lines = ", ".join(f"{c.first_line}-{c.last_line}" if c.last_line > c.first_line else str(c.first_line)
                          for c in self.sources)  # fmt: skip
        return f"focus: answered from {f'lines {lines}' if lines else f'{len(self.passages)} passages'}"


@dataclass(frozen=True)
class Ingested:
    """What `RocketKV.ingest` made: the cache, the file written (None: in memory only), seconds."""

    cache: AnyCache
    path: Path | None
    seconds: float


class RocketKV:
    """A loaded model and everything rocketkv does with it. Build with `RocketKV.load`."""

    def __init__(self, engine: Engine):
        self.engine = engine
        # the last cache focus read (a weak reference, so a server's LRU can still free it), its
        # passages (decoding a whole book's stored text again for every question costs about a
        # second) and, per stored part ranked by attention, its QuestionAttention
        self._passages: tuple[weakref.ref, list[tuple[int, Passage]], dict[int, QuestionAttention]] | None = None
        self._kept = KeptAnswerer()  # `ask`'s decode buffers over the cache it last answered from
        self.threads: int | None = None  # torch's threads as `load` set them (None: not set by `load`)

    def release(self, cache: AnyCache | None = None) -> None:
        """Free the decode buffers `ask` keeps for the cache it last answered from (a copy of its
        keys and values, with the question prefix prefilled: the next question over the same
        cache object starts sooner), if they are over `cache` (any cache: None) and not in use."""
        self._kept.release(None if cache is None else
                           cache.segments if isinstance(cache, SegmentedKVCache) else [cache])  # fmt: skip

    @staticmethod
    def placement(device: str = "auto", dtype: str = "auto") -> tuple[str, str]:
        """The device and dtype names `load` resolves `device` and `dtype` to (`auto`: CUDA when
        present, else the CPU; bfloat16 on CUDA, float32 on the CPU), e.g. ("cpu", "float32").
        Raises ModelLoadError as `load` does (CUDA named but absent, an unknown name)."""
        where = resolve_device(device)
        return str(where), str(resolve_dtype(dtype, where)).removeprefix("torch.")

    def held_bytes(self) -> int:
        """Bytes of memory held for answering beyond the model and the caches: the decode buffers
        `ask` keeps (`release` frees them): a copy, in the model's dtype, of the keys and values of
        the cache it last answered from, plus a question's working set."""
        return self._kept.held_bytes()

    @classmethod
    def load(
        cls,
        model: str = DEFAULT_MODEL,
        device: str = "auto",
        dtype: str = "auto",
        trust_remote_code: bool = False,
        log: Log = lambda message: None,
        weights: str | None = None,
        threads: int | None = None,
        compile_step: bool = False,
    ) -> RocketKV:
        """Load a model offline: a preset (`gemma-3-270m`, `smollm2-135m`), a Hugging Face model
        directory, a `.gguf` file or a hub id already in the local cache. device: cpu, cuda[:N]
        or auto; dtype: auto, float32, bfloat16 or float16; weights: float, head-bf16 (the LM
        head alone), head-int4 (the LM head alone, greedy tokens certified equal to float's),
        mlp-bf16 (head-int4 and bfloat16 MLP linears in decode steps), bf16, int8 or int4
        (weight-only linears for CPU decode in a float32 model, `model/weights.py`), None: the
        model's measured default on a CPU (`core.config.default_weights`).

        threads: torch's threads from now on (process-wide, as `torch.set_num_threads`); None:
        `$ROCKETKV_THREADS` or `$OMP_NUM_THREADS` when set, else what the command line chooses:
        the cores this process may use less those other processes kept busy since rocketkv was
        imported (`api.threads`; torch's own default, every core, ran a decode 4x slower beside a
        busy core). The number chosen is `self.threads`.
        compile_step: decode through a step compiled once by `torch.compile` where it applies
        (`model/captured.py`: a CPU, the Llama and Gemma 3 layouts, exact attention): the first
        answer pays seconds of compilation, later steps skip most of the eager step's Python
        calls; the logits are the eager step's bit for bit (docs/performance.md).
        Raises ModelLoadError; UsageError for a thread count < 1 or above the machine's CPUs."""
        if not isinstance(model, (str, os.PathLike)):
            raise UsageError(f"model must be a preset name or a path, got {type(model).__name__}")
        model = os.fspath(model)  # a Path: read as its text (it was a TypeError inside)
        _flag("trust_remote_code", trust_remote_code)
        _flag("compile_step", compile_step)
        if threads is not None:
            _positive_count("threads", threads)
        _callable("log", log)
        asked = requested_threads(threads)
        loaded = load_model(model, device=device, dtype=dtype, trust_remote_code=trust_remote_code, progress=log,
                            weights=weights, kept=PreparedTensors(home() / "prepared"))  # fmt: skip
        if kernels_choice() == "triton" and loaded.device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise UsageError(f"ROCKETKV_KERNELS=triton runs on a CUDA device; the model is on {loaded.device}",
                             "unset it (auto runs Triton on a GPU), or set TRITON_INTERPRET=1")  # fmt: skip
        n_threads = (asked or default_threads(wait=True))[0]  # other processes' load since rocketkv was imported
        apply_threads(n_threads)
        made = cls(Engine(loaded, compile_step=compile_step))
        made.threads = n_threads
        return made

    @property
    def model_id(self) -> str:
        return self.engine.loaded.model_id

    @property
    def description(self) -> str:
        """The model as its load line names it: "gemma-3-270m on cpu (float32, head-int4 weights)",
        "smollm2-135m on cpu (float32, bf16 weights, bf16 working sets)" (`Engine.working_set_dtype`)."""
        loaded = self.engine.loaded
        weights = f", {loaded.weights} weights" if loaded.weights != "float" else ""
        working = self.engine.working_set_dtype
        if working is not None:
            weights += f", {str(working).removeprefix('torch.').replace('bfloat16', 'bf16')} working sets"
        what = str(loaded.dtype).removeprefix("torch.") + weights
        return f"{loaded.model_id} on {loaded.device} ({what})"

    def ingest(
        self,
        document: str | Path | TextStream | None = None,
        *,
        text: str | None = None,
        output: str | Path | None = None,
        force: bool = False,
        config: PrefillConfig | None = None,
        storage: KVStorage | str | None = None,
        segment_tokens: int | None = None,
        progress: TokenProgress = lambda done, total: None,
        on_segment: Callable[[SegmentDone], None] = lambda event: None,
        **config_fields,
    ) -> Ingested:
        """Prefill a document once and prune its KV cache (SnapKV++); write it to `output` if given.

        document: a path (`-` = stdin) or an open `TextStream`; or `text=` for an in-memory text.
        config: stage-1 settings, or their fields as keywords (`token_budget=512`, …; fields not
            given take the preset's measured defaults, `core.config.PRESET_PREFILL_DEFAULTS`).
        storage: how keys/values are stored — a `KVStorage`, or its name (`auto` = the model's
        dtype, `float32`, `bfloat16`, `float16`, `int8`, `int4`, `+rope`, `+hadamard`, `+sinksN`;
        docs/storage.md); None: the preset's measured default (`core.config.default_kv_dtype`:
        int4 on smollm2-135m, int8 otherwise).
        A document longer than the model's context is ingested in segments, each checkpointed
        beside `output` (in a temporary folder without one) so a rerun resumes an interrupted
        ingest. Writes are atomic; an existing `output` is replaced only with `force`.
        Raises:
            InputError, OutputError, BudgetError; UsageError: invalid config fields or storage.
        """
        _callable("progress", progress)
        _callable("on_segment", on_segment)
        _flag("force", force)
        if output is not None and (not isinstance(output, (str, os.PathLike)) or isinstance(output, bytes)):
            raise UsageError(f"output must be a str or a pathlib.Path, got {type(output).__name__}")
        if config is not None and not isinstance(config, PrefillConfig):
            raise UsageError(f"config must be a PrefillConfig, got {type(config).__name__}",
                             "or give its fields as keywords")  # fmt: skip
        if storage is not None and not isinstance(storage, (str, KVStorage)):
            raise UsageError(f"storage must be a KVStorage or its name, got {type(storage).__name__}")
        if segment_tokens is not None and (isinstance(segment_tokens, bool) or not isinstance(segment_tokens, int)):
            raise UsageError(f"segment_tokens must be a token count, got {segment_tokens!r}")
        if document is None and text is None:
            raise InputError("give a document: a path, or text=")
        if document is not None and text is not None:
            raise InputError("give a document path or text=, not both")
        if text is not None and not isinstance(text, str):
            raise InputError(f"text= must be a str, got {type(text).__name__}", "decode bytes first")
        try:
            cfg = config or preset_config(self.model_id, config_fields)
            if storage is None:
                storage = default_kv_dtype(self.model_id)
            kv = storage if isinstance(storage, KVStorage) else KVStorage.parse(storage)
        except (ValueError, TypeError) as exc:  # TypeError: a keyword no config field has
            raise UsageError(f"invalid option: {exc}") from None
        stream: TextStream | TextPieces
        if text is not None:
            stream = TextPieces(text, "<text>")
        elif isinstance(document, TextStream):
            stream = document
        else:
            stream = open_document(str(document))
        target = None
        if output is not None:
            doc_path = None if isinstance(document, TextStream) or document is None else str(document)
            target = check_output(output, force, doc_path)
        checkpoints = Checkpoints(target) if target is not None else _scratch_checkpoints()
        t0 = time.perf_counter()
        try:
            cache = ingest_stream(self.engine, stream, cfg, segment_tokens, checkpoints, on_segment, progress, kv)
            if target is not None:
                save_cache(cache, target, force=force)
                if isinstance(cache, SegmentedKVCache):
                    cache = verify_file(target)  # the checkpoints go only once the file reads back whole
                checkpoints.remove()
        finally:  # failed or interrupted: the checkpoints stay for a rerun, which may run in another process
            checkpoints.release()
        return Ingested(cache=cache, path=target, seconds=time.perf_counter() - t0)

    def open(self, path: str | Path) -> AnyCache:
        """Load a `.kv` file and check it was built for this model. Raises CacheFormatError;
        UsageError: `path` is not a str or a path."""
        if not isinstance(path, (str, os.PathLike)) or isinstance(path, bytes):
            raise UsageError(f"path must be a str or a pathlib.Path, got {type(path).__name__}")
        cache = read_cache(path)
        self.check(cache, str(path))
        return cache

    def check(self, cache: AnyCache, path: str | None = None) -> None:
        """Refuse a cache built for another model, tokenizer or template. Raises CacheFormatError."""
        first = cache.segments[0] if isinstance(cache, SegmentedKVCache) else cache
        self.engine.check(first, path)

    def ask(
        self,
        cache: AnyCache,
        questions: str | Iterable[str],
        *,
        max_new_tokens: int | None = None,
        dense: bool = False,
        hsa: bool = False,
        topk: int | None = None,
        page_size: int | None = None,
        n_score_dims: int | None = None,
        segments: int = 1,
        segment: int | None = None,
        temperature: float = 0.0,
        top_p: float = 1.0,
        seed: int | None = None,
        on_text: TextCallback | None = None,
        cite: int = 0,
        log: Log = lambda message: None,
    ) -> Iterator[Answer]:
        """Answer each question independently from `cache`; yields `Answer`s in order (lazily:
        a question is answered when its `Answer` is asked for).

        max_new_tokens: answer cap (default: what the cache planned for). dense: exact attention
        over the stored cache instead of stage-2 HSA; hsa: HSA even where this device's measured
        crossover says exact attention is faster (`HSA_MIN_TOKENS`). topk/page_size/n_score_dims: stage-2
        overrides. segments/segment: for a segmented cache, answer from the `segments` best
        matching segments, or from segment `segment`. temperature/top_p/seed: sampling
        (`Sampling`; temperature 0 = greedy, the default). on_text(piece): called with the text
        of the answer being decoded as it becomes final (the pieces of one answer joined equal
        its `text`). cite: the number of source passages to cite per answer
        (`Answer.citations`, `api/citations.py`). Every question is checked before any is answered.
        Raises:
            InputError: an empty question, a bad override, sampling option or segment; `cite`
            for a cache without token offsets, or with segments > 1. BudgetError: a question that
            does not fit the context. UsageError: max_new_tokens or segments not a positive
            integer, cache not an opened cache.
        """
        max_new = self._max_new(cache, max_new_tokens)  # checks the cache first
        qs = _question_list(questions)
        if on_text is not None:
            _callable("on_text", on_text)
        overrides = self._overrides(dense, hsa, topk, page_size, n_score_dims)
        _check_segments(segments, segment)
        check_segment(cache, segment)
        check_cite(cache, cite, segments)
        unused_overrides_note(cache, dense, overrides, log)
        try:
            sampling = Sampling(temperature=temperature, top_p=top_p, seed=seed)
            if isinstance(cache, SegmentedKVCache):
                return answer_segmented(self.engine, cache, qs, max_new, not dense, overrides, segments, segment, log,
                                        sampling, on_text, cite, self._kept)  # fmt: skip
            decode = decode_config_for(cache, sparse=not dense, **overrides)
        except ValueError as exc:
            raise InputError(f"invalid option: {exc}") from None  # may depend on the cache's budgets: exit 1
        return answer(self.engine, cache, qs, max_new, decode, sampling=sampling, on_text=on_text,
                      cite=citer(self.engine.tokenizer, cache, cite), kept=self._kept)  # fmt: skip

    def ask_focused(self, cache: AnyCache, question: str, *, passages: int = FOCUS_PASSAGES,
                    max_new_tokens: int | None = None, cite: bool = False, keep_start: bool = False,
                    on_text: TextCallback | None = None, on_chosen: Callable[[Focused], None] | None = None,
                    ranking: str = "bm25") -> Focused:  # fmt: skip
        """Answer `question` from the `passages` passages of the cache's text that match it best,
        re-read next to it (`api/focus.py`: BM25 over passages of whole lines, a short prefill of
        their text with this model's defaults), greedy; from the whole cache as `ask` when no
        passage shares a word with the question. The answer's `prefill_s` includes the passages'
        prefill; with `cite`, its citations are the passages (characters and lines of the source;
        weight: the share of their ranking scores), in document order. keep_start: re-read the
        document's first passage too (`focus.rank`). on_text: as `ask`'s. on_chosen: called once the
        passages are chosen, before the answer is decoded, with a `Focused` whose answer is None.
        ranking: how passages are ranked (`focus.FOCUS_RANKINGS`; "attention" and "mixed" prefill
        the question over each stored part, `focus.QuestionAttention`: a book's every segment).
        Raises:
            InputError: an empty question; a cache without token ids (or, with `cite`, without
            token offsets: an old file). UsageError: `passages` < 1; an unknown ranking.
        """
        picked: list[Focused] = []

        def chosen(focused: Focused) -> None:
            picked.append(focused)
            if on_chosen is not None:
                on_chosen(focused)

        stream = self.stream_focused(cache, question, passages=passages, max_new_tokens=max_new_tokens, cite=cite,
                                     keep_start=keep_start, on_chosen=chosen, ranking=ranking)  # fmt: skip
        for piece in stream:
            if on_text is not None:
                on_text(piece)
        assert stream.answer is not None  # set when the iteration ends
        return dataclasses.replace(picked[0], answer=stream.answer)

    def stream_focused(self, cache: AnyCache, question: str, *, passages: int = FOCUS_PASSAGES,
                       max_new_tokens: int | None = None, cite: bool = False, keep_start: bool = False,
                       on_chosen: Callable[[Focused], None] | None = None,
                       ranking: str = "bm25") -> AnswerStream:  # fmt: skip
        """`ask_focused` as an iterator of text pieces (what `chat --focus` prints as they are
        decoded); the `Answer` is in the stream's `answer` once it is exhausted. Options and errors
        as `ask_focused`'s (raised when the iteration starts); `on_chosen` gets the passages first."""

        def steps() -> Generator[str, None, Answer]:
            self._opened(cache)
            if max_new_tokens is not None:
                _positive_count("max_new_tokens", max_new_tokens)
            check_questions([question])
            check_ranking(ranking, passages)  # before any work
            if cite:
                check_cite(cache, 1)
            if self._passages is None or self._passages[0]() is not cache:
                self._passages = (weakref.ref(cache), stored_passages(self.engine, cache), {})
            cut, readers, attention = self._passages[1], self._passages[2], None
            if ranking != "bm25":  # the question prefilled over each stored part in turn
                parts, attention = all_segments(cache), []
                for j in sorted({j for j, _ in cut}):
                    if j not in readers:
                        readers[j] = QuestionAttention(self.engine, parts[j])
                    attention += readers[j].passage_scores(question, parts[j], [p for k, p in cut if k == j])
            ranked = focus_ranked([p.text for _, p in cut], question, passages, keep_start, ranking, attention)
            chosen = [(cut[i][0], dataclasses.replace(cut[i][1], score=score)) for i, score in ranked]
            max_new = self._max_new(cache, max_new_tokens)
            citable = all_segments(cache)[0].token_offsets is not None
            sources = tuple(source_passages(self.engine, cache, chosen)) if chosen and citable else ()
            if on_chosen is not None:
                on_chosen(Focused(None, tuple(p for _, p in chosen), sources))
            if not chosen:
                whole = self.stream(cache, question, max_new_tokens=max_new)
                ans = yield from whole.steps()
                return dataclasses.replace(ans, citations=() if cite else None)
            short = self.ingest(text=focus_text([p for _, p in chosen]))
            got = yield from self.stream(short.cache, question, max_new_tokens=max_new).steps()
            return dataclasses.replace(got, prefill_s=got.prefill_s + short.seconds,
                                       citations=sources if cite else None)  # fmt: skip

        return AnswerStream(steps())

    def session(
        self,
        cache: AnyCache,
        *,
        max_new_tokens: int | None = None,
        dense: bool = False,
        hsa: bool = False,
        topk: int | None = None,
        page_size: int | None = None,
        n_score_dims: int | None = None,
        segments: int = 1,
        segment: int | None = None,
        temperature: float = 0.0,
        top_p: float = 1.0,
        seed: int | None = None,
        cite: int = 0,
        log: Log = lambda message: None,
    ) -> Session:
        """A `Session` answering questions one at a time from `cache` (what `rocketkv chat` runs):
        the decode buffers are made once, not per question. Options as `ask`.
        Raises:
            InputError: a bad override, sampling option or segment. UsageError: as `ask`'s.
        """
        max_new = self._max_new(cache, max_new_tokens)
        overrides = self._overrides(dense, hsa, topk, page_size, n_score_dims)
        _check_segments(segments, segment)
        check_segment(cache, segment)
        check_cite(cache, cite, segments)
        unused_overrides_note(cache, dense, overrides, log)
        try:
            sampling = Sampling(temperature=temperature, top_p=top_p, seed=seed)
            first = cache.segments[0] if isinstance(cache, SegmentedKVCache) else cache
            decode_config_for(first, sparse=not dense, **overrides)  # validates the overrides now
        except ValueError as exc:
            raise InputError(f"invalid option: {exc}") from None  # may depend on the cache's budgets: exit 1
        return Session(self.engine, cache, max_new, not dense, overrides, sampling, segments, segment, log, cite)

    def stream(self, cache: AnyCache, question: str, **options) -> AnswerStream:
        """The answer to one question as an iterator of text pieces (options as `ask`); the
        `Answer` is in the stream's `answer` once it is exhausted:

            stream = rk.stream(cache, "Who wrote it?")
            for piece in stream:
                print(piece, end="", flush=True)
            print(stream.answer.stop_reason)
        """
        return self.session(cache, **options).stream(question)

    def _overrides(self, dense: bool, hsa: bool, topk: int | None, page_size: int | None,
                   n_score_dims: int | None) -> dict[str, int | None]:  # fmt: skip
        """Stage-2 overrides, with the device's HSA crossover unless `hsa`. Raises InputError."""
        AttentionChoice(dense=dense, hsa=hsa)  # the one check of the pair (UsageError)
        crossover = 0 if hsa else hsa_min_tokens(self.engine.loaded.device.type)
        return {
            "topk": topk,
            "page_size": page_size,
            "n_score_dims": n_score_dims,
            "min_hsa_tokens": crossover,
            "exact_working_set": not hsa,
        }  # a re-selected working set is attended exactly unless --hsa

    def _opened(self, cache: AnyCache) -> None:
        """Refuse what is not an opened cache (UsageError) or one built for another model than this
        one (CacheFormatError: a cache opened by another `RocketKV` was answered from, wrongly or
        with a RuntimeError of mismatched shapes)."""
        _check_cache(cache)
        self.check(cache)

    def _max_new(self, cache: AnyCache, max_new_tokens: int | None) -> int:
        """The answer's token limit: `max_new_tokens`, else the cache's plan. Raises UsageError: not
        None or a positive integer (0 took the default, -5 answered nothing, 2.5 was taken)."""
        self._opened(cache)
        if max_new_tokens is not None:
            _positive_count("max_new_tokens", max_new_tokens)
        return max_new_tokens or cache.info.config.max_new_tokens or DEFAULT_MAX_NEW_TOKENS

    def summarize(
        self,
        cache: AnyCache,
        *,
        max_new_tokens: int = 256,
        dense: bool = False,
        config: PrefillConfig | None = None,
        on_partial: Callable[[PartialSummary], None] = lambda event: None,
        on_text: TextCallback | None = None,
        extractive: bool | None = None,
        cite: int = 0,
        write_from: str | None = None,
    ) -> Summary:
        """A summary of the cache's document; hierarchical for a segmented cache (each segment,
        then the summaries, ingested in memory with `config`); never a degenerate one (a
        `summaries.Summary`: its `mode` says whether the model wrote it or sentences were
        extracted; `extractive`: extract without the model writing). on_text(piece): the final
        summary's text once it passed the checks. cite: passages of the source to cite per
        model-written part (`Summary.citations`, and each `PartialSummary`'s; extracted sentences
        cite all their own lines; 0 = none). write_from: "sentences" (the model writes from each
        part's key sentences: extract, then write) or "document" (from the stored part itself;
        `summaries` module docstring). Neither `extractive` nor `write_from` given: the model's
        measured default (`core.config.summary_writing`: the presets extract). Raises BudgetError,
        InputError (`cite` for a cache without token offsets), UsageError (an unknown `write_from`)."""
        self._opened(cache)
        _positive_count("max_new_tokens", max_new_tokens)
        try:
            writing = summary_writing(self.model_id, extractive, write_from, extractable(cache))
        except ValueError as exc:
            raise UsageError(str(exc)) from None
        cfg = config or PrefillConfig(max_new_tokens=max_new_tokens)
        return summarize(self.engine, cache, cfg, max_new_tokens, not dense, on_partial, on_text=on_text,
                         extractive=writing is None, cite=cite, write_from=writing or "document")  # fmt: skip


def _scratch_checkpoints() -> Checkpoints:
    """Checkpoints in a temporary folder (removed at exit), so that a long document ingested in
    memory keeps its finished segments on disk (read back one at a time), not all in RAM."""
    folder = make_scratch_dir()  # named for this process: a later run removes it if this one is killed
    atexit.register(shutil.rmtree, folder, True)
    return Checkpoints(folder / "memory.kv")


__all__ = [
    "DEFAULT_MODEL",
    "PRESETS",
    "Answer",
    "abandoned_ingests",
    "check_cache_file",
    "check_decode_options",
    "check_model_choice",
    "check_output",
    "default_output",
    "AnswerStream",
    "Citation",
    "check_cite",
    "check_segment",
    "Sampling",
    "Session",
    "StoredModel",
    "home",
    "remove_models",
    "stored_models",
    "describe",
    "CompressedKVCache",
    "Ingested",
    "RocketKV",
    "SegmentedKVCache",
    "check_questions",
    "open_document",
    "read_cache",
]


def _check_segments(segments: int, segment: int | None) -> None:
    """Raises UsageError: `segments` not a positive integer (whatever the cache: 0 was taken where
    it had one segment), or given with `segment` (one of the two would be ignored)."""
    _positive_count("segments", segments)
    if segment is not None and segments != 1:
        raise UsageError(f"segment {segment} and segments {segments} ask for two things",
                         "give --segments N (the N best) or --segment J (that one), not both")  # fmt: skip


def _positive_count(name: str, value: object) -> None:
    """Raises UsageError unless `value` is an integer ≥ 1 (any integer type, numpy's too; a bool is not)."""
    try:
        count = operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        count = 0
    if isinstance(value, bool) or count < 1:
        raise UsageError(f"{name} must be a positive integer, got {value!r}")


def _question_list(questions: object) -> list:
    """`questions` (one str, or an iterable of them) as a list; each is checked where it is asked
    (`check_questions`: bytes are refused as bytes). Raises UsageError: neither."""
    if isinstance(questions, (str, bytes)):
        return [questions]
    try:
        return list(questions)  # type: ignore[call-overload]
    except TypeError:
        raise UsageError(f"questions must be a str or a list of str, got {type(questions).__name__}") from None


def _flag(name: str, value: object, none: bool = False) -> None:
    """Raises UsageError unless `value` is True or False (or None where `none`): a truthy string
    such as "no" read as True replaced a file with `force="no"`."""
    if not (isinstance(value, bool) or (none and value is None)):
        raise UsageError(f"{name} must be True or False{' or None' if none else ''}, got {value!r}")


def _callable(name: str, value: object) -> None:
    """Raises UsageError unless `value` can be called (a callback: `on_text`, `progress`, `log`)."""
    if not callable(value):
        raise UsageError(f"{name} must be a function, got {type(value).__name__}")


def _check_cache(cache: object) -> None:
    """Raises UsageError unless `cache` is an opened cache (`RocketKV.open`), naming what it got."""
    if not isinstance(cache, (CompressedKVCache, SegmentedKVCache)):
        what = "a path" if isinstance(cache, (str, Path)) else type(cache).__name__
        hint = "use its .cache" if isinstance(cache, Ingested) else "open it first: cache = rk.open(path)"
        raise UsageError(f"cache must be an opened cache, got {what}", hint)


_STAGE2_FLAGS = (("topk", "--topk"), ("page_size", "--page-size"), ("n_score_dims", "--n-score-dims"))


def unused_overrides_note(cache: AnyCache, dense: bool, overrides: dict[str, int | None], log: Log) -> None:
    """Log a note when stage-2 overrides (`--topk`, `--page-size`, `--n-score-dims`) were given
    but no layer of `cache` will be attended with HSA, so they change nothing: `dense`, every
    question's re-selected working set attended exactly (a store-budget cache without `--hsa`),
    or no layer storing more than `max(topk, min_hsa_tokens)` tokens (the device's crossover,
    `HSA_MIN_TOKENS`). Says nothing when some layer may use HSA, or when the overrides are
    invalid (the caller's check reports those)."""
    given = [flag for name, flag in _STAGE2_FLAGS if overrides.get(name) is not None]
    if not given:
        return
    what = f"{'/'.join(given)} {'tunes' if len(given) == 1 else 'tune'} stage-2 HSA"
    if dense:
        log(f"note: {what}, which --dense turns off: {'it has' if len(given) == 1 else 'they have'} no effect")
        return
    working_set, bound, covered = 0, 0, True  # covered: top-k alone (not the device) made every layer exact
    for part in cache.segments if isinstance(cache, SegmentedKVCache) else (cache,):
        try:
            decode = decode_config_for(part, sparse=True, **overrides)
        except ValueError:
            return
        if part.info.config.store_budget is not None and overrides.get("exact_working_set"):
            working_set = max(working_set, part.info.budgets.prompt_budget)
            continue
        # a segment's context bounds what its layers store; one cache's header says it (no layer is read)
        longest = (
            part.info.n_context_tokens if isinstance(cache, SegmentedKVCache) else max(kept_tokens_per_layer(part))
        )
        if decode.uses_hsa(longest):
            return
        bound, covered = max(bound, decode.topk, decode.min_hsa_tokens), covered and longest <= decode.topk
    if working_set:
        why = f"each question's working set of up to {working_set:,} tokens per layer is attended exactly"
    elif covered:  # --hsa would not change it: HSA reads top-k tokens, and that is all of them
        log(f"note: {what}, which no layer uses here: the top-k covers every token each layer stores")
        return
    else:
        why = f"no layer stores more than {bound:,} tokens, where exact attention is faster on this device"
    log(f"note: {what}, which no layer uses here: {why} (add --hsa to use HSA)")
