"""The captured decode step (model/captured.py) against the eager direct step (model/step.py),
its torch reference: the same logits bit for bit where it applies (its kernels are torch's for
every sum), and the eager step itself wherever it does not."""

import pytest
import torch
from conftest import make_engine, text_of_bytes

from rocketkv_cli.core.config import PrefillConfig
from rocketkv_cli.engine.answer import decode_config_for
from rocketkv_cli.engine.decoder import Decoder
from rocketkv_cli.engine.inputs import Document
from rocketkv_cli.model.captured import CapturedStep, _inductor_as_eager
from rocketkv_cli.model.hf import attention_mass
from rocketkv_cli.model.weights import quantize_weights

STEPS = 10
QUESTIONS = ("Which word comes first?", "What is the seventh word?")


@pytest.fixture(autouse=True)
def _as_in_ci(monkeypatch):
    """Every compile here runs with `CI` set, as on a CI runner (GitHub Actions sets it for every
    user's job): inductor then refuses an implicit fallback for an op it could decompose, which is
    what the captured step keeps as torch's kernel. Without `CI` that check never runs."""
    monkeypatch.setenv("CI", "1")


def _odd_llama_engine():
    """A tiny Llama whose sizes are no multiple of a vector's 16 floats (hidden 84, MLP 100, head
    dim 14): elementwise kernels end in a partial vector."""
    from conftest import byte_tokenizer, tiny_config
    from transformers import AutoModelForCausalLM

    from rocketkv_cli.engine.engine import Engine
    from rocketkv_cli.model.loading import LoadedModel

    torch.manual_seed(0)
    cfg = tiny_config("llama")
    cfg.hidden_size, cfg.intermediate_size, cfg.num_attention_heads, cfg.num_key_value_heads = 84, 100, 6, 2
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").float().eval().requires_grad_(False)
    loaded = LoadedModel(model_id="tiny-odd-llama", model=model, tokenizer=byte_tokenizer(),
                         device=torch.device("cpu"), dtype=torch.float32)  # fmt: skip
    return Engine(loaded)


def _setup(arch: str, weights: str, sparse: bool = False, n_bytes: int = 400):
    engine = _odd_llama_engine() if arch == "odd-llama" else make_engine(arch, torch.float32)
    quantize_weights(engine.model, weights)
    cfg = PrefillConfig(token_budget=32, max_new_tokens=8, window_size=8, pool_kernel_size=5)
    stored = engine.ingest(Document(text_of_bytes(n_bytes, seed=7), "0" * 64, "d.txt"), cfg)
    return engine, stored, decode_config_for(stored, sparse=sparse)


def _run(engine, decoder: Decoder, question: str, tokens: list[int] | None = None) -> tuple[torch.Tensor, list[int]]:
    """Logits `[STEPS + 1, V]` of a question's prefill and STEPS decode steps, and the tokens fed:
    greedy, or `tokens` (teacher forcing, so both steps see the same inputs)."""
    decoder.reset()
    with decoder.attention():
        logits = [decoder.prefill(engine.question_ids(question))[0]]
        fed = []
        for i in range(STEPS):
            fed.append(int(logits[-1].argmax()) if tokens is None else tokens[i])
            logits.append(decoder.decode_one_token(fed[-1])[0])
    return torch.stack(logits), fed


CASES = [("llama", "bf16"), ("llama", "float"), ("gemma3_text", "float"), ("gemma3_text", "bf16"),
         ("mistral", "float"), ("mistral", "bf16"), ("odd-llama", "float"), ("odd-llama", "bf16")]  # fmt: skip


@pytest.mark.parametrize("arch, weights", CASES, ids=[f"{a}-{w}" for a, w in CASES])
def test__captured_step__equals_the_eager_step_bit_for_bit(arch, weights):
    """Two questions on one decoder (the tail reset between them), then a decoder whose buffers
    have other room: every step captured (one graph for any number of keys), the logits equal to
    the eager step's, not close (a bfloat16 linear's input rounds on a float32 difference, and an
    answer changes: inductor's own mean of a norm's squares changed 6 of 40 SmolLM2 answers).
    Gemma 3's and Mistral's tiny models: sliding-window layers over a context longer than their
    window; a Llama of sizes no multiple of the vector width."""
    engine, stored, dec = _setup(arch, weights, n_bytes=700)
    eager = engine.step
    captured = CapturedStep(eager)
    runs = 0
    for tail in (64, 41):
        decoder = Decoder(engine, stored, tail, dec)
        for question in QUESTIONS:
            engine.step = eager
            ref, fed = _run(engine, decoder, question)
            engine.step = captured
            got, _ = _run(engine, decoder, question, fed)
            runs += STEPS
            assert captured.failure is None, captured.failure
            assert captured.captured_steps == runs, "every step must run compiled"
            err = (got - ref).abs()
            assert torch.equal(got, ref), f"max error {float(err.max()):.3g}, mean {float(err.mean()):.3g}"
    engine.step = eager


@pytest.mark.parametrize("arch", ["llama", "gemma3_text"])
def test__captured_step__over_a_bfloat16_working_set_equals_the_eager_step_bit_for_bit(arch):
    """A cache whose questions re-select their working set, held in bfloat16 (SmolLM2's default
    on a CPU with native bfloat16, `Engine.working_set_dtype`): every step captured, the logits
    the eager step's bit for bit (the query's cast, the bfloat16 attention and the output's cast
    are torch's), so `serve --compile-step` answers as `--no-server` does."""
    engine = make_engine(arch, torch.float32)
    quantize_weights(engine.model, "bf16")
    cfg = PrefillConfig(token_budget=32, max_new_tokens=8, window_size=8, pool_kernel_size=5, store_budget=128)
    stored = engine.ingest(Document(text_of_bytes(700, seed=7), "0" * 64, "d.txt"), cfg)
    engine.working_set_dtype = torch.bfloat16
    eager = engine.step
    captured = CapturedStep(eager)
    decoder = Decoder(engine, stored, 64, decode_config_for(stored, exact_working_set=1))
    for i, question in enumerate(QUESTIONS, 1):
        engine.step = eager
        ref, fed = _run(engine, decoder, question)
        assert any(layer.keys.dtype == torch.bfloat16 for layer in decoder.cache.layers), "no bfloat16 working set"
        engine.step = captured
        got, _ = _run(engine, decoder, question, fed)
        assert captured.failure is None, captured.failure
        assert captured.captured_steps == i * STEPS, "every step must run compiled"
        err = (got - ref).abs()
        assert torch.equal(got, ref), f"max error {float(err.max()):.3g}, mean {float(err.mean()):.3g}"
    engine.step = eager


def test__captured_step__norms_of_many_rows_sum_as_torch_does():
    """The reduction inductor would reorder, alone and large: torch.rms_norm over 4,000 rows of
    2,304 (inductor's own mean differs in about a quarter of the outputs here) through the
    captured step's compiler equals the eager call."""
    x, w = torch.randn(4000, 2304) * 4, torch.rand(2304) + 0.5
    with torch.inference_mode():
        ref = torch.rms_norm(x, (2304,), w, 1e-5)
        got = torch.compile(lambda a: torch.rms_norm(a, (2304,), w, 1e-5), backend=_inductor_as_eager)(x)
    assert torch.equal(got, ref), f"{int((got != ref).sum())} of {ref.numel()} differ"


def test__captured_step__a_full_buffer_grows_as_the_eager_step_grows_it():
    """A decoder whose tail has room for fewer tokens than are decoded: the step at a full buffer
    is the eager step's (its append grows the buffers), the next ones captured again over the
    grown buffers (another room: the same graph), the logits the eager step's throughout."""
    engine, stored, dec = _setup("llama", "bf16")
    eager, captured = engine.step, CapturedStep(engine.step)
    question = engine.question_ids(QUESTIONS[0])
    runs = []
    for step in (eager, captured):
        engine.step = step
        decoder = Decoder(engine, stored, len(question) + 3, dec)
        runs.append(_run(engine, decoder, QUESTIONS[0], list(range(80, 80 + STEPS)))[0])
    engine.step = eager
    assert 0 < captured.captured_steps < STEPS, captured.captured_steps
    assert torch.equal(runs[0], runs[1]), f"max error {float((runs[0] - runs[1]).abs().max()):.3g}"


def test__captured_step__writes_what_the_eager_step_writes():
    """After the same steps, the layers hold the same keys, values, positions and lengths."""
    engine, stored, dec = _setup("llama", "float")
    eager, captured = engine.step, CapturedStep(engine.step)
    layers = []
    for step in (eager, captured):
        engine.step = step
        decoder = Decoder(engine, stored, 32, dec)
        _run(engine, decoder, QUESTIONS[0], list(range(65, 65 + STEPS)))
        layers.append(decoder.cache.layers)
    engine.step = eager
    for a, b in zip(*layers, strict=True):
        assert a.length == b.length and a.n_context == b.n_context
        assert torch.equal(a.view()[2], b.view()[2])
        assert torch.equal(a.view()[0], b.view()[0]) and torch.equal(a.view()[1], b.view()[1])


def _eager_and_captured(engine, stored, dec, *, extra=None) -> tuple[torch.Tensor, torch.Tensor, CapturedStep]:
    eager = engine.step
    captured = CapturedStep(eager)
    out = []
    for step in (eager, captured):
        engine.step = step
        with extra() if extra else _null():
            out.append(_run(engine, Decoder(engine, stored, 32, dec), QUESTIONS[0], list(range(70, 70 + STEPS)))[0])
    engine.step = eager
    return out[0], out[1], captured


class _null:
    def __enter__(self):
        return None

    def __exit__(self, *a):
        return False


NOT_APPLIED = ["hsa", "qwen3-qk-norm", "qwen2-bias", "int8", "gemma-mlp-bf16", "attention-mass", "hook"]


@pytest.mark.parametrize("case", NOT_APPLIED)
def test__captured_step__is_the_eager_step_where_it_does_not_apply(case):
    """Stage-2 HSA, q/k norms in a pre-norm layout (Qwen 3), projections with biases, a weight
    format it does not compile (int8; bf16 in Gemma's MLPs only), an attention mass being
    collected, a hook: every step is the eager step's, bit for bit, and none is counted as
    captured."""
    arch = {"qwen3-qk-norm": "qwen3", "qwen2-bias": "qwen2", "gemma-mlp-bf16": "gemma3_text"}.get(case, "llama")
    weights = {"int8": "int8", "gemma-mlp-bf16": "mlp-bf16"}.get(case, "bf16")
    engine, stored, dec = _setup(arch, weights, sparse=case == "hsa", n_bytes=900)
    if case == "hsa":
        assert any(dec.uses_hsa(layer.n_kept_tokens) for layer in stored.layers), "HSA must really select"
    extra = None
    if case == "attention-mass":
        extra = lambda: attention_mass(stored.n_context_tokens + 64, torch.device("cpu"))  # noqa: E731
    if case == "hook":
        engine.model.model.layers[0].mlp.register_forward_hook(lambda m, i, o: o)
    ref, got, captured = _eager_and_captured(engine, stored, dec, extra=extra)
    assert captured.captured_steps == 0
    assert torch.equal(ref, got), f"max error {float((ref - got).abs().max()):.3g}"


def test__captured_step__a_failed_compilation_leaves_the_eager_step():
    """A compiler that fails (no C++ compiler, a torch limit) is remembered; the step it was
    building, and every later one, is the eager step's, with the layers as they were."""
    engine, stored, dec = _setup("llama", "bf16")
    eager = engine.step
    captured = CapturedStep(eager)
    calls = []

    def broken(*args):
        calls.append(1)
        if len(calls) == 2:  # the second layer: the first was written
            raise RuntimeError("inductor: no working C++ compiler\nmore detail")
        return captured_compiled(*args)

    captured_compiled, captured._compiled = captured._compiled, broken
    ref, got, _ = None, None, None
    engine.step = eager
    ref, fed = _run(engine, Decoder(engine, stored, 32, dec), QUESTIONS[1])
    engine.step = captured
    got, _ = _run(engine, Decoder(engine, stored, 32, dec), QUESTIONS[1], fed)
    engine.step = eager
    assert captured.failure == "RuntimeError: inductor: no working C++ compiler"
    assert captured.captured_steps == 0 and len(calls) == 2
    assert torch.equal(ref, got)


def test__captured_step__a_model_loaded_again_reuses_its_graphs(monkeypatch):
    """A model of the same configuration loaded again (the server evicts and reloads): its step
    compiles nothing new, and decodes captured at once."""
    from torch._dynamo.utils import counters

    from rocketkv_cli.model import captured as captured_module

    monkeypatch.setattr(captured_module, "_COMPILED", {})
    engine, stored, dec = _setup("llama", "bf16")
    first = _eager_and_captured(engine, stored, dec)[2]
    assert first.failure is None and first.captured_steps > 0, first.failure
    graphs = counters["stats"]["unique_graphs"]
    engine, stored, dec = _setup("llama", "bf16")  # another model object of the same configuration
    ref, got, again = _eager_and_captured(engine, stored, dec)
    assert again.captured_steps == first.captured_steps and torch.equal(ref, got)
    assert counters["stats"]["unique_graphs"] == graphs, "a reloaded model compiled again"


def test__captured_step__each_model_compiles_past_another_models_graphs(monkeypatch):
    """Dynamo stops compiling a function past `recompile_limit` graphs. Each model configuration keeps its own:
    with the limit at 2, a Llama's two graphs (fixed sizes, then symbolic) and then a Mistral's
    two, in one process, all captured (with the functions shared, the Mistral's compile would hit
    the limit and its every step would be eager)."""
    import torch._dynamo

    from rocketkv_cli.model import captured as captured_module

    monkeypatch.setattr(captured_module, "_COMPILED", {})
    for arch in ("llama", "mistral"):
        engine, stored, dec = _setup(arch, "bf16")
        with torch._dynamo.config.patch(recompile_limit=2):
            ref, got, captured = _eager_and_captured(engine, stored, dec)
        assert captured.failure is None, captured.failure
        assert captured.captured_steps > STEPS // 2, arch  # the steps with room in the buffer
        assert torch.equal(ref, got), f"max error {float((ref - got).abs().max()):.3g}"


def test__captured_step__inductor_lowering_in_another_process_is_refused(monkeypatch):
    """$TORCHINDUCTOR_FX_COMPILE_MODE=subprocess lowers graphs in a child process, where the kept
    kernels' fallbacks are not registered: the step refuses to compile there and stays eager."""
    from torch._inductor import compile_fx as compile_fx_module

    from rocketkv_cli.model import captured as captured_module

    monkeypatch.setattr(compile_fx_module, "fx_compile_mode", compile_fx_module.FxCompileMode.SUBPROCESS)
    monkeypatch.setattr(captured_module, "_COMPILED", {})  # a model this process compiled before keeps its graphs
    engine, stored, dec = _setup("llama", "float")
    ref, got, captured = _eager_and_captured(engine, stored, dec)
    assert captured.captured_steps == 0 and "another process" in (captured.failure or ""), captured.failure
    assert torch.equal(ref, got)


def test__captured_step__torch_compile_refused_at_construction_leaves_the_eager_step(monkeypatch):
    """torch.compile raises on some Pythons (3.15, free-threaded builds before 3.13.3): the step is
    built anyway, its failure says why, and it decodes as the eager step."""

    def refused(*args, **kwargs):
        raise RuntimeError("torch.compile is not supported on Python 3.15+")

    from rocketkv_cli.model import captured as captured_module

    monkeypatch.setattr(torch, "compile", refused)
    monkeypatch.setattr(captured_module, "_COMPILED", {})
    engine, stored, dec = _setup("llama", "bf16")
    ref, got, captured = _eager_and_captured(engine, stored, dec)
    assert captured.failure == "RuntimeError: torch.compile is not supported on Python 3.15+"
    assert captured.captured_steps == 0 and torch.equal(ref, got)
