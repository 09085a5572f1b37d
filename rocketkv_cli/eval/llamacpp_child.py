"""llama.cpp's own prompt-cache path on one document, for `rocketkv bench --llama-cpp` (a child process).

Runs with only llama-cpp-python and the standard library (no torch, no rocketkv), so it works in
whatever interpreter has llama-cpp-python installed (it builds from source: an optional bench
extra, never a runtime dependency). Steps, as a llama.cpp user would do them: evaluate the framed
document once and save llama.cpp's state file (`llama_state_save_file`: its full KV cache); then,
as a later question would, load that file into a fresh context, evaluate the framed question
(time to first token, state load included) and decode greedily (median seconds per token).
Prints one JSON object on stdout.

    python llamacpp_child.py MODEL.gguf DOC.txt QUESTION.txt WORKDIR N_THREADS N_NEW_TOKENS

The `answer` form is what a fresh llama.cpp process does for a later question (the parent times
its whole wall, interpreter start and model load included, beside a fresh `rocketkv ask`): load
the model and the state file, evaluate the question and decode N_NEW_TOKENS greedily.

    python llamacpp_child.py answer MODEL.gguf STATE.bin QUESTION.txt N_CTX N_THREADS N_NEW_TOKENS
"""

from __future__ import annotations

import ctypes
import json
import os
import statistics
import sys
import time


def llama_options(gguf: str, n_threads: str) -> dict:
    """`Llama` options shared by every context here: the model, the thread count, quiet."""
    return dict(model_path=gguf, n_threads=int(n_threads), n_threads_batch=int(n_threads), n_batch=512, verbose=False)


def main(argv: list[str]) -> int:
    gguf, doc_path, question_path, workdir, n_threads, n_new = argv
    from llama_cpp import Llama, llama_cpp

    document = open(doc_path, encoding="utf-8").read()
    question = open(question_path, encoding="utf-8").read()
    kw = llama_options(gguf, n_threads)
    probe = Llama(n_ctx=512, vocab_only=True, **kw)
    doc_tokens = probe.tokenize(document.encode("utf-8"), add_bos=True, special=True)
    q_tokens = probe.tokenize(question.encode("utf-8"), add_bos=False, special=True)
    n_ctx = len(doc_tokens) + len(q_tokens) + int(n_new) + 16
    del probe
    llm = Llama(n_ctx=n_ctx, **kw)
    t0 = time.perf_counter()
    llm.eval(doc_tokens)
    prefill_s = time.perf_counter() - t0
    state = os.path.join(workdir, "llama-state.bin")
    arr = (llama_cpp.llama_token * len(doc_tokens))(*doc_tokens)
    if not llama_cpp.llama_state_save_file(llm._ctx.ctx, state.encode(), arr, len(doc_tokens)):
        raise RuntimeError("llama_state_save_file failed")
    del llm
    fresh = Llama(n_ctx=n_ctx, **kw)  # a later question: a new context, the state from the file
    load_s, ttft, steps = answer_from_state(fresh, state, q_tokens, n_ctx, int(n_new))
    print(json.dumps({"llama_cpp_n_context_tokens": len(doc_tokens), "llama_cpp_prefill_s": prefill_s,
                      "llama_cpp_state_file_bytes": os.path.getsize(state), "llama_cpp_state_load_s": load_s,
                      "llama_cpp_ttft_s": ttft, "llama_cpp_decode_step_s": statistics.median(steps[2:] or steps),
                      "llama_cpp_threads": int(n_threads), "llama_cpp_state_file": state,
                      "llama_cpp_n_ctx": n_ctx}))  # fmt: skip
    return 0


def answer_from_state(llm, state: str, q_tokens: list[int], n_ctx: int, n_new: int) -> tuple[float, float, list[float]]:
    """Load llama.cpp's state file into `llm` (a fresh `Llama`), evaluate the question and decode
    `n_new` tokens greedily. Returns (state load s, time to first token s incl. the load, step s)."""
    import numpy as np
    from llama_cpp import llama_cpp

    t0 = time.perf_counter()
    out = (llama_cpp.llama_token * n_ctx)()
    count = ctypes.c_size_t(0)
    if not llama_cpp.llama_state_load_file(llm._ctx.ctx, state.encode(), out, n_ctx, ctypes.byref(count)):
        raise RuntimeError("llama_state_load_file failed")
    llm.n_tokens = count.value
    llm.input_ids[: count.value] = list(out)[: count.value]
    load_s = time.perf_counter() - t0
    n_vocab = llm.n_vocab()

    def greedy() -> int:  # the last evaluated position's logits, read from the context itself
        ptr = llama_cpp.llama_get_logits_ith(llm._ctx.ctx, -1)
        return int(np.argmax(np.ctypeslib.as_array(ptr, shape=(n_vocab,))))

    llm.eval(q_tokens)
    token = greedy()
    ttft = time.perf_counter() - t0
    steps = []
    for _ in range(n_new):
        t1 = time.perf_counter()
        llm.eval([token])
        token = greedy()
        steps.append(time.perf_counter() - t1)
    return load_s, ttft, steps


def answer_main(argv: list[str]) -> int:
    """A fresh process answering one question from the state file (the `answer` form above)."""
    gguf, state, question_path, n_ctx, n_threads, n_new = argv
    from llama_cpp import Llama

    llm = Llama(n_ctx=int(n_ctx), **llama_options(gguf, n_threads))
    question = open(question_path, encoding="utf-8").read()
    q_tokens = llm.tokenize(question.encode("utf-8"), add_bos=False, special=True)
    answer_from_state(llm, state, q_tokens, int(n_ctx), int(n_new))
    return 0


if __name__ == "__main__":
    sys.exit(answer_main(sys.argv[2:]) if sys.argv[1:2] == ["answer"] else main(sys.argv[1:]))
