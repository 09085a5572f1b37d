"""Loading models: the causal LM and its tokenizer (`load_model`), offline, with their digests
(weights, config, tokenizer, chat template) remembered under the rocketkv home.

Where a model comes from (presets, local HF directories, `.gguf` files, cached hub ids) is
`resolve.py`'s; never downloads weights from a hub.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..core.config import default_weights
from ..errors import ModelLoadError
from .prepared import KeptTensors
from .resolve import (  # noqa: F401  (DTYPES, gguf_path, preset_of_file … re-exported: their callers import them here)
    DEFAULT_MODEL,
    DTYPES,
    PRESETS,
    Progress,
    gguf_path,
    preset_of_file,
    resolve_device,
    resolve_dtype,
    resolve_model_dir,
    rocketkv_home,
)
from .weights import quantize_weights


@dataclass
class LoadedModel:
    """A model ready for rocketkv. `model_id` is the preset name or the resolved path/hub id."""

    model_id: str
    model: Any  # a transformers PreTrainedModel
    tokenizer: Any  # a transformers tokenizer
    device: torch.device
    dtype: torch.dtype
    weights_digest: str | None = None  # sha256 of the weight files (None: in-memory model)
    weights: str = "float"  # the decode weight format (`model.weights.WEIGHT_FORMATS`)
    tokenizer_files: tuple[Path, ...] = ()  # what the tokenizer was loaded from (digest caching)


def load_model(
    model: str = DEFAULT_MODEL,
    device: str = "auto",
    dtype: str = "auto",
    trust_remote_code: bool = False,
    progress: Progress = lambda _msg: None,
    weights: str | None = None,
    kept: KeptTensors | None = None,
) -> LoadedModel:
    """Load a causal LM and its tokenizer, offline.

    Args:
        model: preset name, directory, `.gguf` path, or a hub id already in the local HF cache.
        device: cpu, cuda[:N] or auto. dtype: auto (`resolve_dtype`), float32, bfloat16 or float16.
        weights: "float" (as loaded), "head-bf16" or "head-int4" (the LM head alone; head-int4's
            greedy tokens are certified to be float's), "mlp-bf16" (head-int4 and bfloat16 MLP
            linears in decode steps), or weight-only "bf16",
            "int8" or "int4" linears (CPU; `model.weights`; the model stays float32 under `auto`).
            None: the model's measured default (`core.config.default_weights`) for a float32
            model on the CPU, else "float".
        kept: where head-int4 keeps its prepared head (`model/prepared.py`; the API passes
            `store.prepared.PreparedTensors` under the rocketkv home); None: computed every load.
        progress: called with one-line status messages (for stderr).
    Raises:
        ModelLoadError: not found, no weights, unsupported, or no CUDA.
    """
    from transformers import AutoModelForCausalLM

    dev = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, dev)
    model_id, where = resolve_model_dir(model, progress)
    if weights is None:
        weights = default_weights(model_id) if dev.type == "cpu" and torch_dtype == torch.float32 else "float"
        if weights in ("head-int4", "mlp-bf16") and not hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu"):
            weights = "head-bf16"  # a default must load: this torch has no int4 CPU kernel
    local_only = {"local_files_only": True, "trust_remote_code": trust_remote_code}
    try:
        cfg_model_type = _config_model_type(where)
        from .cache_layer import SUPPORTED_MODEL_TYPES

        if cfg_model_type is not None and cfg_model_type not in SUPPORTED_MODEL_TYPES:
            raise ModelLoadError(
                f"unsupported architecture {cfg_model_type!r}; rocketkv supports {', '.join(SUPPORTED_MODEL_TYPES)}",
                "choose a model of a supported architecture with --model",
            )
        tok = load_tokenizer(where, trust_remote_code)
        with _no_loading_bar():
            lm = AutoModelForCausalLM.from_pretrained(where, dtype=torch_dtype, **local_only)
    except ModelLoadError:
        raise
    except (OSError, ValueError, KeyError) as exc:
        raise ModelLoadError(
            f"cannot load model {model!r}: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}",
            "rocketkv never downloads models: use a preset, a local directory, a .gguf, or a hub id already cached",
        ) from exc
    lm.to(dev).eval()  # type: ignore[arg-type]
    lm.requires_grad_(False)
    files = sorted(Path(where).glob("*.safetensors")) if Path(where).is_dir() else []
    digest = weights_file_digest(files) if files else None
    try:
        quantize_weights(lm, weights, digest, kept)
    except ValueError as exc:
        raise ModelLoadError(str(exc), "use --weights float") from exc
    return LoadedModel(
        model_id=model_id,
        model=lm,
        tokenizer=tok,
        device=dev,
        dtype=torch_dtype,
        weights_digest=digest,
        weights=weights,
        tokenizer_files=tuple(tokenizer_files(where)),  # its digest is then computed once per file version
    )


class DigestCache:
    """sha256 digests of files, remembered under the rocketkv home by (path, size, mtime), so a
    file is read (or a tokenizer serialised) once per version of it, not at every start-up."""

    def __init__(self) -> None:
        self.path = rocketkv_home() / "digests.json"
        try:
            self.known = json.loads(self.path.read_text())
        except (OSError, ValueError):
            self.known = {}
        if not isinstance(self.known, dict):  # a damaged store is rebuilt, never trusted
            self.known = {}
        self.changed = False

    @staticmethod
    def key(kind: str, files: list[Path]) -> str:
        parts = [f"{f.resolve()}:{f.stat().st_size}:{f.stat().st_mtime_ns}" for f in files]
        return f"{kind}:" + "|".join(parts) if kind else parts[0]

    def get(self, key: str, compute: Callable[[], str]) -> str:
        if key not in self.known:
            self.known[key], self.changed = compute(), True
        return self.known[key]

    def save(self) -> None:
        if not self.changed:
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=".digests-", suffix=".tmp")
            with os.fdopen(fd, "w") as out:
                json.dump(self.known, out)
            os.replace(tmp, self.path)
        except OSError:
            pass  # a read-only home only costs a re-hash next time


def _file_sha256(path: Path) -> str:
    fh = hashlib.sha256()
    with open(path, "rb") as src:
        while block := src.read(1 << 24):
            fh.update(block)
    return fh.hexdigest()


def weights_file_digest(files: list[Path]) -> str:
    """sha256 over the bytes of every weight file, in name order; each file's digest is cached
    (`DigestCache`), so it is read in full once per file version."""
    cache, h = DigestCache(), hashlib.sha256()
    for f in files:
        digest = cache.get(cache.key("", [f]), functools.partial(_file_sha256, f))
        h.update(f"{f.name}:{digest}".encode())
    cache.save()
    return h.hexdigest()


def tokenizer_files(where: str) -> list[Path]:
    """The files a tokenizer in model directory `where` is loaded from (empty: not a directory)."""
    path = Path(where)
    if not path.is_dir():
        return []
    names = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model", "vocab.json",
             "merges.txt", "added_tokens.json")  # fmt: skip
    return [path / n for n in names if (path / n).is_file()]


_FINGERPRINT_PROBES = ("", "Hello world", "  two leading spaces", "ünïcödé ✓ 中文 😀 \x00", "a\n\n  b\tc\r\n",
                      "1234567 3.14 -0.5e10", "Yes , it 's . Don 't ! (x) [y]",
                      "<bos><eos><|im_start|><|endoftext|> <s></s>")  # fmt: skip
_CLEANUP_FLAGS = ("clean_up_tokenization_spaces",
                  "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output")  # fmt: skip
_DIRECT_TOKENIZER_SCHEME = 1  # bump when `_direct_tokenizer` or `tokenizer_fingerprint` change: old verdicts lapse


def _tokenizer_libraries() -> str:
    """The versions of the libraries that load and serialise tokenizers (part of digest keys)."""
    import tokenizers
    import transformers

    return f"transformers-{transformers.__version__},tokenizers-{tokenizers.__version__}"


def tokenizer_fingerprint(tokenizer) -> str:
    """sha256 over what rocketkv uses of a tokenizer, as far as these checks reach: its
    serialisation and size, special tokens and their ids, the decode clean-up flags, the chat
    template and a rendering of it, and the ids, offsets and decoded text of probe strings (one
    made of all its special tokens), with and without special tokens. Padding and truncation,
    never used by rocketkv, are not compared."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    specials = " ".join(map(str, tokenizer.all_special_tokens))
    parts: dict[str, Any] = {
        "backend": backend.to_str() if backend is not None else sorted(tokenizer.get_vocab().items()),
        "size": len(tokenizer),
        "special": {k: str(v) for k, v in sorted(tokenizer.special_tokens_map.items())},
        "special_ids": sorted(tokenizer.all_special_ids),
        "ids": [tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id, tokenizer.unk_token_id],
        "cleanup": [getattr(tokenizer, flag, None) for flag in _CLEANUP_FLAGS],
        "template": getattr(tokenizer, "chat_template", None),
    }  # fmt: skip
    probes = (*_FINGERPRINT_PROBES, f"a {specials} b")
    for special in (True, False):
        enc = [tokenizer(p, add_special_tokens=special, return_offsets_mapping=True) for p in probes]
        parts[f"encode-{special}"] = [(list(e["input_ids"]), [list(o) for o in e["offset_mapping"]]) for e in enc]
        parts[f"decode-{special}"] = [tokenizer.decode(e["input_ids"], skip_special_tokens=special) for e in enc]
    if parts["template"]:
        turns = [("user", "Q?"), ("assistant", "A."), ("user", "R")]
        messages = [{"role": role, "content": text} for role, text in turns]
        try:
            parts["chat"] = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        except Exception as exc:  # a template that refuses this conversation refuses it in both
            parts["chat"] = f"{type(exc).__name__}: {exc}"
    return hashlib.sha256(json.dumps(parts, default=str, ensure_ascii=False).encode()).hexdigest()


def _direct_tokenizer(where: Path) -> Any:
    """A `PreTrainedTokenizerFast` read straight from `tokenizer.json` (special tokens and chat
    template from `tokenizer_config.json` / `chat_template.jinja`), without the model-specific
    class: Gemma's rebuilds its 262K-entry vocabulary and merges in Python at every load."""
    from transformers import PreTrainedTokenizerFast

    config = json.loads((where / "tokenizer_config.json").read_text(encoding="utf-8"))
    kwargs: dict[str, Any] = {}
    for key, value in config.items():
        if key.endswith("_token") and isinstance(value, dict) and isinstance(value.get("content"), str):
            value = value["content"]  # the older AddedToken form
        if key.endswith("_token") and isinstance(value, str):
            kwargs[key] = value
    for key in ("model_max_length", "add_bos_token", "add_eos_token", *_CLEANUP_FLAGS):
        if key in config:
            kwargs[key] = config[key]
    template = where / "chat_template.jinja"
    chat = template.read_text(encoding="utf-8") if template.is_file() else config.get("chat_template")
    tok = PreTrainedTokenizerFast(tokenizer_file=str(where / "tokenizer.json"), **kwargs)
    if isinstance(chat, str):
        tok.chat_template = chat
    return tok


def load_tokenizer(where: str, trust_remote_code: bool = False) -> Any:
    """The tokenizer of model directory (or cached hub id) `where`, offline.

    `AutoTokenizer` builds the model's own tokenizer class; for a directory with a `tokenizer.json`
    the same tokenizer read directly (`_direct_tokenizer`) loads faster (Gemma 3: 3.8-4.1 s →
    1.0-1.4 s on 2 cores, `benchmarks/tokenizer_load.py` at commit 50e17b4). The direct load is used
    only once it has been shown
    equal (`tokenizer_fingerprint`) to `AutoTokenizer`'s for this version of the files and of
    transformers and tokenizers: the first load makes both and compares them, and the verdict is
    remembered in the rocketkv home (`DigestCache`); a tokenizer that differs keeps `AutoTokenizer`.
    That first load is slower than `AutoTokenizer` alone (both tokenizers are built and each is
    serialised once: about +1.5 s for Gemma, once per file version). The verdict's key holds every
    file `AutoTokenizer` reads for it (tokenizer files, chat templates, config.json) with its size
    and mtime, the library versions and `_DIRECT_TOKENIZER_SCHEME`.

    Raises: OSError, ValueError or KeyError from transformers (no tokenizer, unreadable files).
    """
    from transformers import AutoTokenizer

    local_only = {"local_files_only": True, "trust_remote_code": trust_remote_code}
    path = Path(where)
    if trust_remote_code or not (path / "tokenizer.json").is_file() or not (path / "tokenizer_config.json").is_file():
        return AutoTokenizer.from_pretrained(where, **local_only)
    extra = [path / "chat_template.jinja", path / "config.json", *sorted(path.glob("additional_chat_templates/*"))]
    files = tokenizer_files(where) + [f for f in extra if f.is_file()]
    kind = f"direct-tokenizer-{_DIRECT_TOKENIZER_SCHEME}@{_tokenizer_libraries()}"
    cache = DigestCache()
    key = DigestCache.key(kind, files)
    if cache.known.get(key) == "same":
        with contextlib.suppress(Exception):  # anything unexpected: the verified path below
            return _direct_tokenizer(path)
    auto = AutoTokenizer.from_pretrained(where, **local_only)
    if key in cache.known:
        return auto
    try:
        direct = _direct_tokenizer(path)
        verdict = "same" if tokenizer_fingerprint(direct) == tokenizer_fingerprint(auto) else "differs"
    except OSError:  # a passing read error: decide another time
        return auto
    except Exception:  # a tokenizer the direct path cannot build: keep AutoTokenizer
        verdict = "differs"
    cache.get(key, lambda: verdict)
    cache.save()
    return auto


def _config_model_type(where: str) -> str | None:
    cfg = Path(where) / "config.json"
    if not cfg.is_file():
        return None
    try:
        return json.loads(cfg.read_text()).get("model_type")
    except (OSError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"unreadable config.json in {where}: {exc}") from exc


_VOLATILE_CONFIG_KEYS = {"transformers_version", "dtype", "torch_dtype", "quantization_config", "architectures"}


def model_digest(model: Any, weights_digest: str | None = None) -> str:
    """sha256 over the config and the weights, independent of the dtype the model was loaded in.

    weights_digest: digest of the weight files (`weights_file_digest`), which covers every byte.
    Without it (a model built in memory) every weight is fingerprinted in memory: the bf16 bytes of
    each tensor, all of them.
    """
    h = hashlib.sha256()
    cfg = {k: v for k, v in model.config.to_dict().items() if not k.startswith("_") and k not in _VOLATILE_CONFIG_KEYS}
    h.update(json.dumps(cfg, sort_keys=True, default=str).encode())
    if weights_digest is not None:
        h.update(weights_digest.encode())
        return h.hexdigest()
    for name, p in sorted(model.state_dict().items()):
        sample = p.detach().reshape(-1).to("cpu", torch.bfloat16).view(torch.int16)
        h.update(f"{name}:{tuple(p.shape)}".encode())
        h.update(sample.numpy().tobytes())
    return h.hexdigest()


def tokenizer_digest(tokenizer, files: list[Path] | None = None) -> str:
    """sha256 of the tokenizer's full serialisation (vocab, merges, normalisation, special tokens).

    files: the files it was loaded from; when given, the digest is remembered per version of them
    (`DigestCache`): Gemma's 262K-entry tokenizer takes a second to serialise at every start-up."""

    def compute() -> str:
        backend = getattr(tokenizer, "backend_tokenizer", None)
        text = backend.to_str() if backend is not None else json.dumps(sorted(tokenizer.get_vocab().items()))
        return hashlib.sha256(text.encode()).hexdigest()

    if not files:
        return compute()
    # the serialisation depends on the libraries that load and write it, not only on the files
    kind = f"tokenizer@{_tokenizer_libraries()}"
    cache = DigestCache()
    digest = cache.get(DigestCache.key(kind, files), compute)
    cache.save()
    return digest


def chat_template_digest(tokenizer) -> str:
    """sha256 of the chat template, or "none"."""
    template = getattr(tokenizer, "chat_template", None)
    return hashlib.sha256(template.encode()).hexdigest() if template else "none"


def stop_token_ids(model: Any, tokenizer) -> set[int]:
    """Union of the generation config's and the tokenizer's EOS ids (a model may stop on either)."""
    ids: set[int] = set()
    gen = getattr(model, "generation_config", None)
    for source in (getattr(gen, "eos_token_id", None), getattr(tokenizer, "eos_token_id", None)):
        if isinstance(source, int):
            ids.add(source)
        elif source:
            ids.update(int(i) for i in source)
    return ids


def transformers_version() -> str:
    import transformers

    return transformers.__version__


@contextlib.contextmanager
def _no_loading_bar():
    """transformers' own "Loading weights" bar off for the block (restored after): `RocketKV.load`
    from a script would otherwise print it, in a log file as a line of carriage returns; the
    caller's `log` line says what was loaded."""
    from transformers.utils import logging as hf_logging

    was = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was:
            hf_logging.enable_progress_bar()


def configure_transformers(quiet: bool, progress_bars: bool) -> None:
    """Offline, quiet transformers: no hub access, no advisory warnings, errors only in its log;
    its own progress bars (the GGUF conversion's tqdm) only when `progress_bars`."""
    if quiet:
        os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if not progress_bars:
        os.environ.setdefault("TQDM_DISABLE", "1")
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
