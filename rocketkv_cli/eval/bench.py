"""`rocketkv bench`: speed, memory and file size of rocketkv vs full attention, side by side (docs/performance.md).

Everything is measured in one process on the same machine and reported as ratios, except peak
memory, which is the peak resident set of two child processes (`ask` from the file vs plain
transformers answering over the whole document). No printing here: rows go back to the CLI.
"""

from __future__ import annotations

import atexit
import hashlib
import json
import platform
import runpy
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from .. import ops
from ..core.cache import CompressedKVCache, full_kv_bytes
from ..core.config import PrefillConfig
from ..core.quant import KVStorage
from ..engine.answer import decode_config_for
from ..engine.decoder import Decoder
from ..engine.engine import Engine
from ..engine.inputs import Document, tokenize
from ..model.captured import CapturedStep
from ..model.hf import PlainDecoder
from ..model.weights import weights_bytes
from ..store.format import load_cache, save_cache

QUESTION = "Who is mentioned first in this text, and what happens to them?"
Log = Callable[[str], None]


def build_document(engine: Engine, source_text: str, n_tokens: int) -> Document:
    """A document of about `n_tokens` framed tokens cut from `source_text` (repeated if short)."""
    text = source_text
    while len(tokenize(engine.tokenizer, text[: 8 * n_tokens], False)) < n_tokens:
        text += "\n" + source_text
    ids = tokenize(engine.tokenizer, text[: 8 * n_tokens], False)
    overhead = len(engine.document_ids(Document("x", "", ""))) - 1
    body = engine.tokenizer.decode(ids[: max(1, n_tokens - overhead)])
    return Document(text=body, sha256=hashlib.sha256(body.encode()).hexdigest(), source=f"bench-{n_tokens}")


def hsa_bytes_per_step(engine: Engine, stored: CompressedKVCache, elem: int) -> int:
    """Cache bytes HSA reads per decode step: page min/max on the chosen dims + top-k K/V per full
    layer, the whole window per sliding layer (the memory-traffic ideal, docs/performance.md)."""
    b = stored.info.budgets
    s, total = engine.shape, 0
    for layer, spec in zip(stored.layers, s.layers):
        kept = layer.n_kept_tokens
        if spec.sliding_window or kept <= b.topk:
            total += 2 * s.n_kv_heads * kept * s.head_dim * elem
        else:
            pages = -(-kept // b.page_size)
            total += s.n_kv_heads * (2 * pages * b.n_score_dims + 2 * b.topk * s.head_dim) * elem
    return total


def _median_step_s(step: Callable[[], object], steps: int, warmup: int) -> float:
    times = []
    for i in range(warmup + steps):
        t0 = time.perf_counter()
        step()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def full_attention_decode_s(engine: Engine, ids: list[int], steps: int, warmup: int) -> tuple[float, float]:
    """Plain transformers: prefill `ids` in one call (time = full re-prefill TTFT), then decode.

    Returns (seconds to first token, median seconds per decode step).
    """
    t0 = time.perf_counter()
    plain = PlainDecoder(engine.model)
    token = plain.prefill(engine.ids(ids))
    ttft = time.perf_counter() - t0

    def step() -> None:
        nonlocal token
        token = plain.decode_one_token(token)

    return ttft, _median_step_s(step, steps, warmup)


def rocketkv_answer_s(
    engine: Engine,
    path: Path,
    question: str,
    steps: int,
    warmup: int,
    sparse: bool = True,
    direct: bool = True,
    reselect: bool = True,
) -> tuple[float, float]:
    """From the saved file: load, prefill the question, first token (TTFT); then decode steps with
    HSA at every full-attention layer (`sparse`, whatever the crossover) or exact attention over
    the same pruned cache; through the direct decode step (`model/step.py`) or, `direct` false,
    through the model's forward (`forward_tokens`, the step's reference). `reselect` false: no
    per-question working set (a cache that stores every token is then attended whole: full
    attention over the stored keys and values, through the same step).

    Returns (seconds to first token including the file load, median seconds per decode step).
    """
    if not direct:
        saved, engine.step = engine.step, None
        try:
            return rocketkv_answer_s(engine, path, question, steps, warmup, sparse, reselect=reselect)
        finally:
            engine.step = saved
    t0 = time.perf_counter()
    stored = load_cache(path)
    if not isinstance(stored, CompressedKVCache):
        raise ValueError(f"{path}: bench documents fit one segment")
    ids = engine.question_ids(question)
    decoder = Decoder(engine, stored, len(ids) + warmup + steps + 8, decode_config_for(stored, sparse), reselect)
    with decoder.attention():
        token = int(decoder.prefill(ids).argmax())
        ttft = time.perf_counter() - t0

        def step() -> None:
            nonlocal token
            token = int(decoder.decode_one_token(token).argmax())

        return ttft, _median_step_s(step, steps, warmup)


def captured_step_s(engine: Engine, path: Path, question: str, steps: int, warmup: int) -> float | None:
    """`rocketkv_answer_s`'s median decode step (exact attention over the working set) through the
    step compiled once (`model/captured.py`, compiled in the warm-up steps); None where it does
    not apply to this model or device (its steps would be the direct step's)."""
    if engine.step is None:
        return None
    saved = engine.step
    captured = engine.step = CapturedStep(saved)  # type: ignore[arg-type]
    try:
        _, step_s = rocketkv_answer_s(engine, path, question, steps, warmup, sparse=False)
    finally:
        engine.step = saved
    return step_s if captured.captured_steps > warmup + steps // 2 else None


def attention_crossover(engine: Engine, sizes: tuple[int, ...], token_budget: int = 512, steps: int = 12) -> list[dict]:
    """One full-attention layer's decode attention, HSA (as `ask` runs it: the stored context's
    pages scored, the selection, sinks and a 32-token question tail attended) vs exact (SDPA), at
    `sizes` stored tokens, on the engine's device and dtype with its head geometry (random keys;
    budgets as ingest would derive them for such a length). Seconds are medians over `steps`."""
    from ..core.config import derive_budgets
    from ..model.hf import exact_decode_attention

    shape, dev, dtype = engine.shape, engine.loaded.device, engine.loaded.dtype
    g = torch.Generator(device="cpu").manual_seed(0)
    rows = []
    for s in sizes:
        b = derive_budgets(s, 128, token_budget, shape.head_dim)
        q = torch.randn(1, shape.n_heads, 1, shape.head_dim, generator=g).to(dev, dtype)
        k = torch.randn(1, shape.n_kv_heads, s + 32, shape.head_dim, generator=g).to(dev, dtype)
        v = torch.randn(1, shape.n_kv_heads, s + 32, shape.head_dim, generator=g).to(dev, dtype)
        pmin, pmax = ops.page_summaries(k[:, :, :s], b.page_size)
        scaling = shape.head_dim**-0.5
        hsa = _median_step_s(lambda: ops.hsa_context_decode(q, k, v, pmin, pmax, s, b.topk, b.page_size,
                                                            b.n_score_dims, 4, scaling), steps, 3)  # fmt: skip
        exact = _median_step_s(lambda: exact_decode_attention(q, k, v, scaling), steps, 3)
        rows.append({"kept_tokens": s, "topk": b.topk, "page_size": b.page_size, "n_score_dims": b.n_score_dims,
                     "hsa_s": hsa, "exact_s": exact, "hsa_speedup": exact / hsa})  # fmt: skip
    return rows


def crossover_tokens(rows: list[dict], margin: float = 1.1) -> int | None:
    """The smallest measured size from which HSA beats exact attention by `margin` at every larger
    size measured; None when it never does."""
    for i, row in enumerate(rows):
        if all(r["hsa_speedup"] >= margin for r in rows[i:]):
            return row["kept_tokens"]
    return None


def _last_line(done: subprocess.CompletedProcess) -> str:
    """The last line a failed child wrote on stderr (300 characters at most)."""
    return (done.stderr.strip().splitlines() or ["no output"])[-1][:300]


def median_wall_s(cmd: list[str], runs: int = 2) -> float:
    """Median wall seconds of `runs` runs of the process `cmd`, after one more run that warms the
    page cache (and rocketkv's digest cache). Raises RuntimeError naming the exit code and the
    last stderr line when a run fails."""
    times = []
    for _ in range(runs + 1):
        t0 = time.perf_counter()
        done = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"exit {done.returncode}: {_last_line(done)}")
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:])


def fresh_ask_s(path: Path, model_id: str, question: str, device: str, dtype: str, runs: int = 2) -> float:
    """Median wall seconds of a new `rocketkv ask` process answering `question` (32 tokens) from
    `path`: interpreter start, imports, model and cache load, question prefill and decode."""
    cmd = [sys.executable, "-m", "rocketkv_cli.cli", "ask", "--cache", str(path), question, "--max-new-tokens", "32",
           "-q", "--model", model_id, "--device", device, "--dtype", dtype,
           "--threads", str(torch.get_num_threads())]  # fmt: skip
    try:
        return median_wall_s(cmd, runs)
    except RuntimeError as exc:
        raise RuntimeError(f"rocketkv ask failed ({exc})") from None


def llama_cpp_row(engine: Engine, document: Document, question: str, python: str, workdir: Path,
                  n_new: int = 24) -> dict:  # fmt: skip
    """llama.cpp's state-file path on the same framed document and question, side by side, in a
    child `python` that has llama-cpp-python (`llamacpp_child.py`), with this process's threads.
    Returns its measurements, or {"llama_cpp_error": why} when it cannot run."""
    from ..model.loading import gguf_path

    gguf = gguf_path(engine.loaded.model_id)
    if gguf is None:
        return {"llama_cpp_error": f"{engine.loaded.model_id} has no GGUF file for llama.cpp"}
    doc, q = workdir / "llama-doc.txt", workdir / "llama-question.txt"
    doc.write_text(engine.prompt.document_text(document.text), encoding="utf-8")
    q.write_text(engine.prompt.question_text(question), encoding="utf-8")
    child = Path(__file__).with_name("llamacpp_child.py")
    cmd = [python, str(child), str(gguf), str(doc), str(q), str(workdir), str(torch.get_num_threads()), str(n_new)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        return {"llama_cpp_error": f"exit {done.returncode}: {_last_line(done)}"}
    row = json.loads(done.stdout.strip().splitlines()[-1])
    # a fresh llama.cpp process for a later question, timed as `fresh_ask_s` times ours (32 tokens)
    answer = [python, str(child), "answer", str(gguf), row.pop("llama_cpp_state_file"), str(q),
              str(row.pop("llama_cpp_n_ctx") + 32), str(torch.get_num_threads()), "32"]  # fmt: skip
    try:
        return {**row, "llama_cpp_fresh_wall_s": median_wall_s(answer)}
    except RuntimeError as exc:
        return {**row, "llama_cpp_error": f"answer: {exc}"}


def peak_rss_bytes(argv: list[str], workdir: Path) -> tuple[int, int]:
    """Run `python -m <module> <args>` (argv = [module, *args]) in a child; return (exit code, peak RSS).

    The child records its own high-water mark (VmHWM) at exit: `ru_maxrss` from wait4 is useless
    here, as Linux children inherit the parent's maxrss across fork and exec.
    """
    out = workdir / "rss.txt"
    out.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "rocketkv_cli.eval.bench", "rss", str(out), *argv]
    proc = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if proc.returncode != 0 or not out.exists():
        raise RuntimeError(f"memory measurement child failed (exit {proc.returncode}): {proc.stderr[-500:]}")
    return proc.returncode, int(out.read_text())


def _rss_main(argv: list[str]) -> None:
    """Child: run module argv[1] as __main__ with argv[2:], then write VmHWM (bytes) to argv[0]."""
    out, module, args = argv[0], argv[1], argv[2:]

    def report() -> None:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                Path(out).write_text(str(int(line.split()[1]) * 1024))

    atexit.register(report)
    sys.argv = [module, *args]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


def machine_info() -> dict:
    from ..model.loading import transformers_version

    cpu = platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    from .. import __version__

    return {
        "rocketkv": __version__, "torch": torch.__version__, "transformers": transformers_version(),
        "python": platform.python_version(), "threads": torch.get_num_threads(), "cpu": cpu,
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }  # fmt: skip


def bench_one(
    engine: Engine,
    source_text: str,
    n_tokens: int,
    cfg: PrefillConfig,
    workdir: Path,
    steps: int = 24,
    warmup: int = 4,
    measure_memory: bool = True,
    log: Log = lambda _m: None,
    fresh_ask: bool = False,
    storage: KVStorage = KVStorage(),
) -> dict:
    """All measurements of docs/performance.md for one context length. Times in seconds, sizes in bytes."""
    document = build_document(engine, source_text, n_tokens)
    elem = torch.tensor([], dtype=engine.loaded.dtype).element_size()
    path = workdir / f"bench-{n_tokens}.kv"
    log(f"{n_tokens} tokens: ingest")
    t0 = time.perf_counter()
    stored = engine.ingest(document, cfg, storage=storage)
    save_cache(stored, path, force=True)
    ingest_s = time.perf_counter() - t0
    n = stored.n_context_tokens
    log(
        f"{n_tokens} tokens: answer from the file (HSA, then exact attention over the same pruned cache: "
        "the direct step, the model's forward, the whole store through the step, the captured step)"
    )
    rk_ttft, rk_step = rocketkv_answer_s(engine, path, QUESTION, steps, warmup)
    _, exact_step = rocketkv_answer_s(engine, path, QUESTION, steps, warmup, sparse=False)
    _, forward_step = rocketkv_answer_s(engine, path, QUESTION, steps, warmup, sparse=False, direct=False)
    _, whole_step = rocketkv_answer_s(engine, path, QUESTION, steps, warmup, sparse=False, reselect=False)
    captured_step = captured_step_s(engine, path, QUESTION, steps, warmup)
    log(f"{n_tokens} tokens: full attention (plain transformers)")
    ids = engine.document_ids(document) + engine.question_ids(QUESTION)
    full_ttft, full_step = full_attention_decode_s(engine, ids, steps, warmup)
    weights = weights_bytes(engine.model)  # what a decode step reads (weight-only formats: their buffers)
    full_kv = full_kv_bytes(
        n, [x.sliding_window for x in engine.shape.layers], engine.shape.n_kv_heads, engine.shape.head_dim, elem
    )
    hsa_kv = hsa_bytes_per_step(engine, stored, elem)
    ideal = (weights + full_kv) / (weights + hsa_kv)
    row = {
        "context_tokens": n, "ingest_s": ingest_s, "prefill_tokens_per_s": n / ingest_s,
        "file_bytes": path.stat().st_size, "full_kv_bytes": full_kv, "file_vs_full_kv": path.stat().st_size / full_kv,
        "ttft_from_file_s": rk_ttft, "ttft_full_reprefill_s": full_ttft, "ttft_speedup": full_ttft / rk_ttft,
        "decode_step_hsa_s": rk_step, "decode_step_exact_pruned_s": exact_step,
        "decode_step_exact_forward_s": forward_step, "direct_step_vs_forward": forward_step / exact_step,
        "decode_step_whole_store_s": whole_step, "working_set_vs_whole_store": whole_step / exact_step,
        "hsa_vs_exact_pruned": exact_step / rk_step, "decode_step_full_s": full_step,
        "decode_speedup": full_step / rk_step, "decode_speedup_exact_pruned": full_step / exact_step,
        "weights_bytes": weights, "hsa_kv_bytes_per_step": hsa_kv, "ideal_decode_speedup": ideal,
        "decode_speedup_fraction_of_ideal": (full_step / rk_step) / ideal,
        "budgets": stored.info.budgets_record(),
    }  # fmt: skip
    if captured_step is not None:
        row.update(decode_step_captured_s=captured_step, captured_vs_direct=exact_step / captured_step)
    if measure_memory:
        log(f"{n_tokens} tokens: peak memory of ask vs full attention (child processes)")
        row.update(_memory(engine, path, document, workdir))
    if fresh_ask:
        log(f"{n_tokens} tokens: a fresh `rocketkv ask` process (load + question + 32 tokens)")
        row["fresh_ask_wall_s"] = fresh_ask_s(path, engine.loaded.model_id, QUESTION, engine.loaded.device.type,
                                              engine.dtype_name)  # fmt: skip
    return row


def _memory(engine: Engine, path: Path, document: Document, workdir: Path) -> dict:
    doc_path = workdir / "bench-doc.txt"
    doc_path.write_text(document.text)
    common = ["--device", engine.loaded.device.type, "--dtype", str(engine.loaded.dtype).removeprefix("torch.")]
    ask = ["rocketkv_cli.cli", "ask", "--cache", str(path), QUESTION, "--max-new-tokens", "8", "-q", "--model",
           engine.loaded.model_id, *common]  # fmt: skip
    full = ["rocketkv_cli.eval.bench", "full-answer", engine.loaded.model_id, str(doc_path), *common]
    _, ask_rss = peak_rss_bytes(ask, workdir)
    _, full_rss = peak_rss_bytes(full, workdir)
    return {"peak_rss_ask_bytes": ask_rss, "peak_rss_full_bytes": full_rss, "peak_rss_ratio": ask_rss / full_rss}


def _full_answer_main(argv: list[str]) -> int:
    """Child process: plain transformers answers QUESTION over the whole document (8 tokens)."""
    model_id, doc_path, _, device, _, dtype = argv
    from ..model.loading import load_model

    engine = Engine(load_model(model_id, device=device, dtype=dtype))
    document = Document(Path(doc_path).read_text(), "", doc_path)
    ids = engine.document_ids(document) + engine.question_ids(QUESTION)
    full_attention_decode_s(engine, ids, steps=4, warmup=0)
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["full-answer"]:
        sys.exit(_full_answer_main(sys.argv[2:]))
    if sys.argv[1:2] == ["rss"]:
        _rss_main(sys.argv[2:])
        sys.exit(0)
    sys.exit(2)
