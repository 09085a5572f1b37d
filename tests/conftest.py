"""Shared test fixtures: tiny random-init models of each supported architecture, built in code.

Real-model values are in comments (Liger style); the tiny ones keep the same structure (GQA group
sizes, sliding-window layers, q/k norms, softcapping) at a size that runs in milliseconds.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

# One OpenMP thread per process unless the caller chose: many tests run several rocketkv processes
# at once (batch workers, 8 readers, a writer), and on 2 cores torch's spinning threads slow all of
# them (the suite took 922 s with torch's default and 710 s with one thread, here). Set before
# torch is imported; the CLI subprocesses inherit it.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

# Triton kernels run on CPU tensors only under its interpreter, which is read when kernels are
# defined: set it before anything imports triton, and only where no GPU would run them natively.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

SHARED_DATA = Path(__file__).resolve().parents[2] / "shared" / "data"
if not SHARED_DATA.is_dir():  # CI lays shared/ beside the clone
    SHARED_DATA = Path(os.environ.get("ROCKETKV_SHARED_DATA", "/work/shared/data"))


def byte_tokenizer():
    """A byte-level fast tokenizer (256 byte tokens + <s>, </s>), nanochat style; adds BOS."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {"<s>": 0, "</s>": 1, **{ch: i + 2 for i, ch in enumerate(sorted(alphabet))}}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")


VOCAB = 258


def tiny_config(arch: str):
    """Config of a 2–4 layer random model of `arch` (real values in comments)."""
    import transformers as tf

    common = dict(vocab_size=VOCAB, max_position_embeddings=4096, bos_token_id=0, eos_token_id=1, pad_token_id=1)
    if arch == "llama":  # Llama-3.1-8B: 32 layers, 32 heads / 8 KV (G=4), head_dim 128
        return tf.LlamaConfig(hidden_size=96, intermediate_size=128, num_hidden_layers=2, num_attention_heads=6,
                              num_key_value_heads=2, **common)  # fmt: skip
    if arch == "qwen2":  # Qwen2.5-0.5B: 24 layers, 14 heads / 2 KV (G=7), head_dim 64; here G=7 too
        return tf.Qwen2Config(hidden_size=112, intermediate_size=128, num_hidden_layers=2, num_attention_heads=7,
                              num_key_value_heads=1, **common)  # fmt: skip
    if arch == "mistral":  # Mistral-7B-v0.1: 32 layers, 32 heads / 8 KV, sliding window 4096 on every layer
        return tf.MistralConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                num_key_value_heads=2, sliding_window=16, **common)  # fmt: skip
    if arch == "qwen3":  # Qwen3: q/k RMS norms before RoPE
        return tf.Qwen3Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                              num_key_value_heads=2, head_dim=16, **common)  # fmt: skip
    if arch == "phi3":  # Phi-3-mini-4k: fused qkv projection, sliding window 2047 on every layer
        return tf.Phi3Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                             num_key_value_heads=2, sliding_window=16, **common)  # fmt: skip
    if arch == "gemma3_text":  # Gemma 3 270M: 18 layers (5 sliding : 1 full), 4 heads / 1 KV, d=256, window 512
        return tf.Gemma3TextConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                                   num_key_value_heads=1, head_dim=32, query_pre_attn_scalar=24, sliding_window=16,
                                   layer_types=["sliding_attention", "full_attention", "sliding_attention",
                                                "full_attention"], **common)  # fmt: skip
    if arch == "gemma2":  # Gemma 2: alternating sliding/full layers, attention logit soft-capping 50
        return tf.Gemma2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                               num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=16, sliding_window=16,
                               attn_logit_softcapping=5.0, **common)  # fmt: skip
    raise ValueError(arch)


ARCHS = ("llama", "qwen2", "mistral", "qwen3", "phi3", "gemma3_text", "gemma2")


def tiny_model(arch: str, dtype=torch.float64, seed: int = 0):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    cfg = tiny_config(arch)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").to(dtype).eval()
    model.requires_grad_(False)
    return model


def make_engine(arch: str, dtype=torch.float64, seed: int = 0, device: str | torch.device = "cpu"):
    """A rocketkv Engine over a tiny random model and the byte tokenizer, on `device`."""
    from rocketkv_cli.engine.engine import Engine
    from rocketkv_cli.model.loading import LoadedModel

    model = tiny_model(arch, dtype, seed).to(device)
    loaded = LoadedModel(model_id=f"tiny-{arch}", model=model, tokenizer=byte_tokenizer(), device=torch.device(device),
                         dtype=dtype)  # fmt: skip
    return Engine(loaded)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """A saved tiny Llama (safetensors + tokenizer) for CLI tests through `--model DIR`."""
    path = tmp_path_factory.mktemp("tiny-llama")
    model = tiny_model("llama", torch.float32)
    model.save_pretrained(path)
    byte_tokenizer().save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def rocketkv_bin() -> str:
    """The installed `rocketkv` console script (tests run the real CLI in a subprocess)."""
    exe = Path(sys.executable).parent / "rocketkv"
    if not exe.exists():
        pytest.fail("the rocketkv console script is not installed: pip install '.[test]'")
    return str(exe)


def text_of_bytes(n: int, seed: int = 0) -> str:
    """Deterministic ASCII text of n bytes (n byte-level tokens), words from a small vocabulary."""
    g = torch.Generator().manual_seed(seed)
    words = ["alpha", "river", "stone", "green", "seven", "cloud", "north", "paper", "light", "metal"]
    out = []
    while sum(len(w) + 1 for w in out) < n:
        out.append(words[int(torch.randint(0, len(words), (1,), generator=g))])
    return " ".join(out)[:n]


def run_in_terminal(argv: list[str], env: dict, timeout: float = 600, cwd=None, columns: int = 100):
    """Run `argv` with stdin, stdout and stderr on a pseudo-terminal, as in a user's shell.

    Rich draws its progress bars and spinners only when stderr is a terminal, so this is the code
    path a pipe-only test never runs. Returns (exit code, everything the terminal showed, as text
    with `\\r\\n` line ends and ANSI escapes kept).
    """
    import fcntl
    import pty
    import select
    import struct
    import subprocess
    import termios
    import time

    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, columns, 0, 0))
    env = {**env, "TERM": "xterm-256color", "COLUMNS": str(columns)}
    env.pop("NO_COLOR", None)
    proc = subprocess.Popen(argv, stdin=slave, stdout=slave, stderr=slave, env=env, cwd=cwd, close_fds=True,
                            start_new_session=True)  # fmt: skip
    os.close(slave)
    chunks, deadline = [], time.monotonic() + timeout
    try:
        while True:
            if time.monotonic() > deadline:
                proc.kill()
                raise TimeoutError(f"{argv} ran over {timeout}s; output so far: {b''.join(chunks)[-2000:]!r}")
            ready, _, _ = select.select([master], [], [], 0.2)
            if ready:
                try:
                    data = os.read(master, 65536)
                except OSError:  # EIO: the child side closed
                    data = b""
                if not data:
                    break
                chunks.append(data)
            elif proc.poll() is not None:
                ready, _, _ = select.select([master], [], [], 0.2)
                if not ready:
                    break
    finally:
        os.close(master)
    return proc.wait(timeout=30), b"".join(chunks).decode("utf-8", "replace")


ANSI_ESCAPE = r"\x1b\[[0-9;?]*[ -/]*[@-~]|\x1b[()][0-9A-Za-z]|\x1b[=>78]"


def strip_ansi(text: str) -> str:
    import re

    return re.sub(ANSI_ESCAPE, "", text)


def same_layer(a, b) -> bool:
    """Two `LayerKV`s hold bit-identical keys, values and positions."""
    return all(torch.equal(getattr(a, k), getattr(b, k)) for k in ("keys", "values", "positions"))


def pytest_collection_modifyitems(config, items):
    """`nightly` tests (scale runs) are opt-in: skipped unless ROCKETKV_NIGHTLY=1."""
    if os.environ.get("ROCKETKV_NIGHTLY") == "1":
        return
    skip = pytest.mark.skip(reason="nightly scale run: set ROCKETKV_NIGHTLY=1 (ROCKETKV_NIGHTLY=1 pytest -m nightly)")
    for item in items:
        if "nightly" in item.keywords:
            item.add_marker(skip)
