"""A decode step captured once: each layer's arithmetic compiled by `torch.compile` (inductor).

`DecodeStep` (step.py) calls a layer's modules one by one: on a CPU a SmolLM2 step runs about a
hundred small tensor operations per layer, each a call from Python (docs/performance.md, "A
captured decode step"). `CapturedStep` runs each layer as one compiled function over the layer's
own static buffers (`_layer` for the pre-norm layouts, `_sandwich_layer` for Gemma 3's): the norms,
the q/k/v projection (and Gemma's q and k norms), RoPE, the new token's key, value and position
written after the layer's last token (`RocketLayer.append`), exact decode attention over the
layer's keys or its sliding window's (`hf.exact_decode_attention`, float32 keys or a bfloat16
working set's; the number of keys a symbolic
size: one graph for every length and every buffer's room), the output projection, the MLP and
the residual adds. Inductor fuses the elementwise work (the norms but for their mean, RoPE, the
SiLU, the adds, the casts) and calls torch's own kernels for the products, the softmax, the
norms' mean and Gemma's GELU (`_inductor_as_eager`), so the logits equal `DecodeStep`'s bit for
bit (`tests/test_captured.py`; docs/performance.md counts identical answers). The embedding,
RoPE's cos and sin, a sliding window's start (`hf.window_start`, a read of the positions), the
final norm and the LM head (a certified head among them) stay eager, as in `DecodeStep`.

It runs where the eager step's attention is exact decode attention in every layer
(`hf.decode_attention_is_exact`: no stage-2 HSA, soft-cap, attention mass or other collector), on
a CPU, for the Llama, Mistral and Qwen 2 layouts without biases or q/k norms and for Gemma 3,
whose linears are all bfloat16 (`Bf16Linear`, joined as `DecodeStep` joins them) or all plain
float32 `nn.Linear`s, with transformers' RMSNorms and SiLU (GELU tanh for Gemma) MLPs, no hooks,
room in every layer's buffers for the token and every sliding window a suffix of its buffer; any
other step is `DecodeStep`'s, unchanged. A compilation that fails makes every later step eager
(`failure` says why).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .hf import RocketCache, decode_attention_is_exact, exact_decode_attention, window_start
from .linears import Bf16Linear, bf16_matvec, decode_step
from .step import DecodeStep, _hooked, _LayerPlan, _rope, rms_norm_kind

_SILU = ("SiLU", "SiLUActivation")  # activations whose forward is F.silu (torch's, transformers')


@dataclass(frozen=True)
class _LayerWeights:
    """The tensors one layer's compiled function reads, taken from its `_LayerPlan`: norm weights
    `[C]`; `qkv` the joined q/k/v weight `[nq + nk + nv, C]` or q, k and v one by one; `o`
    `[C, nq]`; the MLP's `gate_up` joined `[2I, C]` or gate and up; `down` `[C, I]`. All bfloat16
    (`bf16`) or all float32."""

    plan: _LayerPlan  # what they were read from: read again when the step's plan changes
    norms: tuple[torch.Tensor, ...]  # two (pre-norm) or four (Gemma 3)
    qkv: tuple[torch.Tensor, ...]
    o: torch.Tensor
    gate_up: tuple[torch.Tensor, ...]
    down: torch.Tensor
    eps: float
    bf16: bool
    qk_norms: tuple[torch.Tensor, ...] = ()  # q_norm and k_norm weights `[D]` (Gemma 3), or none
    qk_eps: float = 0.0
    sandwich: bool = False  # Gemma 3: four norms of (1 + w), a GELU (tanh) MLP


def _linear(w: torch.Tensor, x: torch.Tensor, bf16: bool) -> torch.Tensor:
    """`w · x`, x `[n]` float32 → `[out]` float32: a bfloat16 weight as `Bf16Linear` multiplies one
    row in a decode step, a float32 one as `F.linear` (the eager step's call for an `nn.Linear`)."""
    if bf16:
        return bf16_matvec(w, x.to(torch.bfloat16)).to(torch.float32)
    return F.linear(x.view(1, 1, -1), w).view(-1)


def _products(weights: tuple[torch.Tensor, ...], x: torch.Tensor, bf16: bool) -> torch.Tensor:
    """`x` `[n]` through one joined weight, or through its parts one by one and joined after:
    `[sum of out]` (q/k/v as `DecodeStep` runs them, joined or not)."""
    if len(weights) == 1:
        return _linear(weights[0], x, bf16)
    return torch.cat([_linear(w, x, bf16) for w in weights])


def _gate_and_up(weights: tuple[torch.Tensor, ...], x: torch.Tensor, bf16: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """An MLP's gate and up `[I]` each, from one joined `[2I, C]` weight or from the two."""
    if len(weights) == 1:
        gu = _linear(weights[0], x, bf16)  # [2I]
        n = gu.shape[0] // 2
        return gu[:n], gu[n:]
    return _linear(weights[0], x, bf16), _linear(weights[1], x, bf16)


def _append_and_attend(
    q: torch.Tensor,  # [1, H, 1, D] after RoPE
    k: torch.Tensor,  # [1, Hkv, 1, D] after RoPE
    v: torch.Tensor,  # [1, Hkv, 1, D]
    keys: torch.Tensor,  # [1, Hkv, N, D]
    values: torch.Tensor,
    positions: torch.Tensor,  # [1, Hkv, N] int64
    length: int,
    start: int,
    position: torch.Tensor,  # [1] int64
    scaling: float,
) -> torch.Tensor:
    """`RocketLayer.append` of the token at `length`, then `hf.exact_decode_attention` over the
    keys from `start` (a sliding window's) to it: `[1, H, 1, D]`."""
    keys[:, :, length : length + 1] = k
    values[:, :, length : length + 1] = v
    positions[:, :, length : length + 1] = position.view(1, 1, 1)
    return exact_decode_attention(q, keys[:, :, start : length + 1], values[:, :, start : length + 1], scaling)


def _layer(
    h: torch.Tensor,  # [1, 1, C] float32, the residual stream
    cos: torch.Tensor,  # [1, D]
    sin: torch.Tensor,  # [1, D]
    length: int,  # the layer's tokens before this one
    start: int,  # the first key inside the layer's window (0: full attention)
    position: torch.Tensor,  # [1] int64: this token's RoPE position
    keys: torch.Tensor,  # [1, Hkv, N, D] float32, the layer's buffers, written at `length`
    values: torch.Tensor,  # [1, Hkv, N, D]
    positions: torch.Tensor,  # [1, Hkv, N] int64
    norms: tuple[torch.Tensor, ...],  # _LayerWeights' tensors, passed one by one: a graph
    qkv: tuple[torch.Tensor, ...],  # of tensors, shared by every layer of these shapes
    o: torch.Tensor,
    gate_up: tuple[torch.Tensor, ...],
    down: torch.Tensor,
    eps: float,
    bf16: bool,
    scaling: float,
    n_heads: int,
) -> torch.Tensor:
    """One pre-norm decoder layer for one token, the operations of `DecodeStep._step` for it (the
    input norm, q/k/v, RoPE, the append of `RocketLayer.append`, `hf.exact_decode_attention` over
    the layer's keys, the output projection, the post-attention norm, the gated SiLU MLP, both
    residual adds): returns the residual stream after the layer `[1, 1, C]`."""
    c = h.shape[-1]
    hkv, d = keys.shape[1], keys.shape[3]
    x = torch.rms_norm(h, (c,), norms[0], eps).view(-1)  # [C]
    joined = _products(qkv, x, bf16)  # [nq + nk + nv]
    nq, nk = n_heads * d, hkv * d
    qk = _rope(joined[: nq + nk].view(-1, d), cos, sin)  # [H + Hkv, D]: q and k at once, as DecodeStep
    out = _append_and_attend(qk[:n_heads].view(1, n_heads, 1, d), qk[n_heads:].view(1, hkv, 1, d),
                             joined[nq + nk :].view(1, hkv, 1, d), keys, values, positions, length, start,
                             position, scaling)  # [1, H, 1, D]  # fmt: skip
    h = h + _linear(o, out.reshape(-1), bf16).view(1, 1, c)
    gate, up = _gate_and_up(gate_up, torch.rms_norm(h, (c,), norms[1], eps).view(-1), bf16)
    return h + _linear(down, F.silu(gate) * up, bf16).view(1, 1, c)


def _sandwich_layer(
    h: torch.Tensor,  # [1, 1, C] float32, the residual stream
    cos: torch.Tensor,  # [1, D]: RoPE of this layer's type (Gemma 3: local or global)
    sin: torch.Tensor,  # [1, D]
    length: int,  # the layer's tokens before this one
    start: int,  # the first key inside the layer's window (0: full attention)
    position: torch.Tensor,  # [1] int64
    keys: torch.Tensor,  # [1, Hkv, N, D] float32, written at `length`
    values: torch.Tensor,  # [1, Hkv, N, D]
    positions: torch.Tensor,  # [1, Hkv, N] int64
    norms: tuple[torch.Tensor, ...],  # input, post-attention, pre- and post-MLP norm weights `[C]`
    qk_norms: tuple[torch.Tensor, ...],  # q_norm and k_norm weights `[D]`
    qkv: tuple[torch.Tensor, ...],
    o: torch.Tensor,
    gate_up: tuple[torch.Tensor, ...],
    down: torch.Tensor,
    eps: float,
    qk_eps: float,
    bf16: bool,
    scaling: float,
    n_heads: int,
) -> torch.Tensor:
    """One Gemma 3 decoder layer for one token, the operations of `DecodeStep._step` for it: the
    norms of `(1 + w)` (`step._fast_norm`), q/k/v, the q and k norms, RoPE, the append, exact
    decode attention over the keys from `start` (a sliding window's, `hf.window_start`), the output
    product normed before its residual add, the GELU (tanh) MLP between its two norms and its
    residual add. Returns `[1, 1, C]`."""
    c = h.shape[-1]
    hkv, d = keys.shape[1], keys.shape[3]
    joined = _products(qkv, torch.rms_norm(h, (c,), 1.0 + norms[0], eps).view(-1), bf16)
    nq, nk = n_heads * d, hkv * d
    q = torch.rms_norm(joined[:nq].view(1, 1, n_heads, d), (d,), 1.0 + qk_norms[0], qk_eps)
    k = torch.rms_norm(joined[nq : nq + nk].view(1, 1, hkv, d), (d,), 1.0 + qk_norms[1], qk_eps)
    q, k = _rope(q.reshape(-1, d), cos, sin), _rope(k.reshape(-1, d), cos, sin)  # as DecodeStep: one by one
    out = _append_and_attend(q.view(1, n_heads, 1, d), k.view(1, hkv, 1, d), joined[nq + nk :].view(1, hkv, 1, d),
                             keys, values, positions, length, start, position, scaling)  # fmt: skip
    out = _linear(o, out.reshape(-1), bf16).view(1, 1, c)
    h = h + torch.rms_norm(out, (c,), 1.0 + norms[1], eps)
    gate, up = _gate_and_up(gate_up, torch.rms_norm(h, (c,), 1.0 + norms[2], eps).view(-1), bf16)
    mlp = _linear(down, F.gelu(gate, approximate="tanh") * up, bf16).view(1, 1, c)
    return h + torch.rms_norm(mlp, (c,), 1.0 + norms[3], eps)


def _inductor_as_eager(graph: Any, example_inputs: Any) -> Any:
    """torch.compile's inductor, with every operation whose result it would compute another way
    left to torch's own kernels, so that the step's logits equal the eager step's bit for bit:
    a bfloat16 linear's product (`mv`: inductor's decomposition sums in another order, and torch's
    kernel is the one measured fastest for one row, `linears.bf16_matvec`), the attention's
    `softmax`, the `mean` of an RMSNorm's squares (torch's `rms_norm` on a CPU is x², mean, + ε,
    rsqrt and products; with inductor's own mean, 6 of 40 SmolLM2 answers changed:
    docs/performance.md), and the MLPs' `silu` and `gelu` (inductor's exponential and tanh round
    otherwise in the elements after the last full vector). What inductor fuses is basic arithmetic
    whose every result is rounded once (adds, products, negation, casts, the norms' rsqrt), so
    the vector width does not change it.

    Inductor is told through its decomposition table (`mv`, `softmax`, `silu`, `gelu`) and, while
    this graph compiles, a fallback for each of them and for `mean` (in place of its lowering),
    registered without inductor's `CI` check (inductor's tables restored
    afterwards; dynamo compiles one graph at a time, under its compile lock). A custom pass that
    changes nothing names this file's contents in inductor's cache key, so that a graph compiled
    another way (the same graph with inductor's own mean) is never read back from its cache
    (torch 2.13's cache passes over these graphs anyway: it cannot key a decomposition table);
    AOTAutograd's cache, whose key does not see the decompositions, is off for the compile. Where
    inductor lowers in another process (`$TORCHINDUCTOR_FX_COMPILE_MODE`), none of this would
    reach it: RuntimeError, and the step stays eager."""
    from torch._functorch import config as functorch_config
    from torch._inductor import compile_fx as compile_fx_module
    from torch._inductor import lowering
    from torch._inductor.compile_fx import compile_fx
    from torch._inductor.decomposition import select_decomp_table

    if getattr(compile_fx_module, "fx_compile_mode", None) is not compile_fx_module.FxCompileMode.NORMAL:
        # $TORCHINDUCTOR_FX_COMPILE_MODE: lowered in another process, without the tables below
        raise RuntimeError("inductor compiles in another process here ($TORCHINDUCTOR_FX_COMPILE_MODE)")

    aten = torch.ops.aten
    kept = {aten.mv.default, aten.mv.out, aten._softmax.default, aten._softmax.out, aten.silu.default,
            aten.gelu.default}  # fmt: skip
    table = {op: fn for op, fn in select_decomp_table().items() if op not in kept}
    # Each kept op and `mean` runs as torch's kernel: a fallback registered here, as inductor itself
    # registers one for an op it has no lowering for, but without its check (under a `CI`
    # environment variable) that an op with a decomposition is never a fallback.
    fallen = [*sorted(kept, key=str), aten.mean.dim]
    saved = {op: (lowering.lowerings.get(op), op in lowering.fallbacks, op in lowering.needs_realized_inputs)
             for op in fallen}  # fmt: skip
    try:
        for op in fallen:
            lowering.lowerings.pop(op, None)
            lowering.make_fallback(op, warn=False, override_decomp=True)
        with functorch_config.patch(enable_autograd_cache=False):
            return compile_fx(graph, example_inputs, decompositions=table,
                              config_patches={"post_grad_custom_post_pass": _cache_key()})  # fmt: skip
    finally:
        for op, (lowered, fallback, realized) in saved.items():
            lowering.lowerings.pop(op, None)
            if lowered is not None:
                lowering.lowerings[op] = lowered
            if not fallback:
                lowering.fallbacks.discard(op)
            if not realized:
                lowering.needs_realized_inputs.discard(op)


def _cache_key() -> Any:
    """A graph pass that changes nothing, whose `uuid` (this file's SHA-256) enters inductor's
    cache key. Defined here: inductor is imported only to compile."""
    from torch._inductor.custom_graph_pass import CustomGraphPass

    class CacheKey(CustomGraphPass):
        def __call__(self, graph: Any) -> None:
            return None

        def uuid(self) -> str:
            return "rocketkv captured step " + hashlib.sha256(Path(__file__).read_bytes()).hexdigest()

    return CacheKey()


def _why(err: BaseException) -> str:
    """The first line of what made a compilation fail, at most 300 characters: the backend's own
    error where dynamo wrapped it (`BackendCompilerFailed` says only which backend raised)."""
    inner = getattr(err, "inner_exception", None)
    err = inner if isinstance(inner, BaseException) else err
    return (f"{type(err).__name__}: {err}".splitlines() or [""])[0][:300]


_COMPILED: dict[tuple, tuple[Any, Any]] = {}  # model key → (compiled `_layer`, compiled `_sandwich_layer`)


def _compiled_for(model: nn.Module) -> tuple[Any, Any]:
    """The compiled layer functions for `model`'s kind, shared by every step over a model of the
    same configuration (a model the server evicts and loads again reuses its graphs) and by no
    other: dynamo keeps compiled graphs on a function's code object and stops compiling it past
    `recompile_limit` graphs (8), each model configuration and weight format adding one or two,
    so one copy of the code for every model would stop compiling in a process that holds several
    (the server). Kept for the process's life: one pair per configuration loaded."""
    import json
    import types

    config = getattr(model, "config", None)
    key = (type(model).__name__, json.dumps(config.to_dict(), sort_keys=True, default=str) if config else "")
    if key not in _COMPILED:
        own = [types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
               for fn in (_layer, _sandwich_layer)]  # fmt: skip
        _COMPILED[key] = (torch.compile(own[0], fullgraph=True, backend=_inductor_as_eager),
                          torch.compile(own[1], fullgraph=True, backend=_inductor_as_eager))  # fmt: skip
    return _COMPILED[key]


class _NotThisStep(Exception):
    """This step is the eager step's (found before any layer ran)."""


class CapturedStep:
    """`step(cache, input_ids [1, 1], positions [1]) → logits [1, V] float32`, as `DecodeStep`,
    with each layer compiled once (see the module docstring for where it applies; elsewhere it is
    `eager`'s step). The first captured step of each model configuration in a process compiles
    (seconds: inductor's graph cache on disk passes over graphs compiled with a decomposition table
    of their own); graphs are shared by every layer of one shape and by every later step over a
    model of the same configuration (`_compiled_for`).

    `captured_steps` counts the steps it ran compiled; `failure` is why compilation failed (then
    every step is eager), None while it has not.
    """

    def __init__(self, eager: DecodeStep):
        self.eager = eager
        self.model, self.shape = eager.model, eager.shape
        self.captured_steps = 0
        self.failure: str | None = None
        self._weights: list[_LayerWeights | None] = []
        self._compiled: Any = None
        self._sandwich: Any = None
        try:  # code objects of this model's configuration: dynamo's graphs, and their limit, are per code object
            self._compiled, self._sandwich = _compiled_for(self.model)
        except Exception as err:  # a Python or build that torch.compile refuses: eager
            self.failure = _why(err)

    def __call__(self, cache: RocketCache, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """One token's logits `[1, V]` float32 (see the class). Raises ValueError: input_ids not
        `[1, 1]` or positions not `[1]`, as `DecodeStep`."""
        if input_ids.shape != (1, 1) or positions.shape != (1,):
            return self.eager(cache, input_ids, positions)  # which raises the ValueError
        with decode_step():  # as DecodeStep: the decode weights (bf16 linears, a certified head)
            return self._call(cache, input_ids, positions)

    def _call(self, cache: RocketCache, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        if self.failure is not None or not self._applies(cache):
            return self.eager(cache, input_ids, positions)
        weights = self._layer_weights()
        if weights is None:
            return self.eager(cache, input_ids, positions)
        lengths = [layer.length for layer in cache.layers]
        try:
            with torch.inference_mode():
                logits = self._step(cache, input_ids, positions, weights)
        except _NotThisStep:
            return self.eager(cache, input_ids, positions)
        except Exception as err:  # inductor failed to build (no compiler, a torch limit): eager from now on
            self.failure = _why(err)
            for layer, n in zip(cache.layers, lengths, strict=True):  # the eager step writes the slot again
                layer.length = n
            return self.eager(cache, input_ids, positions)
        self.captured_steps += 1
        return logits

    def _applies(self, cache: RocketCache) -> bool:
        if (self.eager.qk_norm and not self.eager.sandwich) or _hooked(self.eager._uncalled):
            return False
        if not decode_attention_is_exact(cache):
            return False
        return all(
            layer.keys.device.type == "cpu" and layer.keys.dtype in (torch.float32, torch.bfloat16)
            and layer.values.dtype == layer.keys.dtype and layer.keys.is_contiguous() and layer.values.is_contiguous()
            and layer.positions.is_contiguous() and layer.length < layer.keys.shape[2]
            for layer in cache.layers
        )  # fmt: skip

    def _layer_weights(self) -> list[_LayerWeights] | None:
        """Each layer's tensors, read again from the eager step's plans whenever one changed; None
        when some layer is not of the kind this step compiles."""
        out = []
        for i, layer in enumerate(self.eager.layers):
            plan = self.eager._plan(i, layer)
            held = self._weights[i] if i < len(self._weights) else None
            if held is None or held.plan is not plan:
                held = _weights_of(layer, plan)
                if i < len(self._weights):
                    self._weights[i] = held
                else:
                    self._weights.append(held)
            if held is None:
                return None
            out.append(held)
        kinds = {w.bf16 for w in out}
        return out if len(kinds) == 1 else None

    def _window_starts(self, cache: RocketCache, positions: torch.Tensor) -> list[int] | None:
        """Per layer, the first key the token attends (0 for full attention; a sliding window's
        `hf.window_start`, with the token's own position written where the append puts it, as
        the eager step reads it after the append); None when some window is not a common suffix
        of its buffer (the eager step then runs its masked reference)."""
        starts = []
        for spec, layer in zip(self.shape.layers, cache.layers, strict=True):
            if spec.sliding_window is None:
                starts.append(0)
                continue
            n = layer.length
            layer.positions[:, :, n : n + 1] = positions.view(1, 1, 1)
            start = window_start(layer.positions[:, :, : n + 1], positions, spec)
            if start is None:
                return None
            starts.append(start)
        return starts

    def _step(
        self, cache: RocketCache, input_ids: torch.Tensor, positions: torch.Tensor, weights: list[_LayerWeights]
    ) -> torch.Tensor:
        inner = self.model.model
        cache.query_positions = positions
        h = inner.embed_tokens(input_ids)  # [1, 1, C]
        pos = positions.unsqueeze(0)  # [1, 1]
        types = self.eager.layer_types
        rope: dict[str | None, Any] = {None: inner.rotary_emb(h, pos)} if types is None else {}
        rope.update({t: inner.rotary_emb(h, pos, t) for t in set(types or ())})
        starts = self._window_starts(cache, positions)
        if starts is None:
            raise _NotThisStep
        for i, (layer, w) in enumerate(zip(cache.layers, weights, strict=True)):
            n = layer.length
            cos, sin = (part[0] for part in rope[None if types is None else types[i]])  # [1, D]
            for buf in (layer.keys, layer.values, layer.positions):
                torch._dynamo.maybe_mark_dynamic(buf, 2)  # one graph whatever room a decoder's buffers have
            if w.sandwich:
                h = self._sandwich(h, cos, sin, n, starts[i], positions, layer.keys, layer.values, layer.positions,
                                   w.norms, w.qk_norms, w.qkv, w.o, w.gate_up, w.down, w.eps, w.qk_eps, w.bf16,
                                   self.shape.layers[i].scaling, self.shape.n_heads)  # fmt: skip
                layer.length = n + 1
                continue
            h = self._compiled(h, cos, sin, n, starts[i], positions, layer.keys, layer.values, layer.positions,
                               w.norms, w.qkv, w.o, w.gate_up, w.down, w.eps, w.bf16, self.shape.layers[i].scaling,
                               self.shape.n_heads)  # fmt: skip
            layer.length = n + 1
        logits = self.model.lm_head(inner.norm(h))[:, -1]  # [1, V]  # fmt: skip
        if self.eager.softcap is not None:
            logits = torch.tanh(logits / self.eager.softcap) * self.eager.softcap
        return logits.float()


def _weights_of(layer: Any, plan: _LayerPlan) -> _LayerWeights | None:
    """A layer's `_LayerWeights`, or None when the layer is not one `_layer` or `_sandwich_layer`
    computes as the eager step does (module calls for hooks, biases, another norm, activation or
    linear, bf16 in some linears only)."""
    attn, mlp = layer.self_attn, layer.mlp
    sandwich = hasattr(layer, "pre_feedforward_layernorm")
    names: tuple[str, ...] = ("input_layernorm", "post_attention_layernorm")
    names += ("pre_feedforward_layernorm", "post_feedforward_layernorm") if sandwich else ()
    norms = [getattr(layer, n) for n in names]
    qk = [attn.q_norm, attn.k_norm] if sandwich else []
    if not plan.direct or (plan.q_norm is not None) != sandwich:
        return None
    kind = "1+w" if sandwich else "w"
    if any(rms_norm_kind(n) != kind or n.weight.dtype != torch.float32 for n in norms + qk):
        return None
    act = getattr(mlp, "act_fn", None)
    if sandwich:
        fn: Any = getattr(act, "act", None)  # transformers' GELUTanh: partial(F.gelu, approximate="tanh")
        tanh = getattr(fn, "func", None) is F.gelu and getattr(fn, "keywords", None) == {"approximate": "tanh"}
        if type(act).__name__ != "GELUTanh" or not tanh:
            return None
    elif type(act).__name__ not in _SILU:
        return None
    if not hasattr(mlp, "gate_proj"):
        return None
    linears = [attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj]
    qkv: tuple[torch.Tensor, ...]
    gate_up: tuple[torch.Tensor, ...]
    if all(type(m) is Bf16Linear and m.bias is None for m in linears):
        if plan.qkv_linear is None or plan.gate_up is None:
            return None
        qkv, gate_up = (plan.qkv_linear.weight_bf16,), (plan.gate_up.weight_bf16,)
        o, down, bf16 = attn.o_proj.weight_bf16, mlp.down_proj.weight_bf16, True
    elif all(type(m) is nn.Linear and m.bias is None and m.weight.dtype == torch.float32 for m in linears):
        qkv = (attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight)
        gate_up = (mlp.gate_proj.weight, mlp.up_proj.weight)
        o, down, bf16 = attn.o_proj.weight, mlp.down_proj.weight, False
    else:
        return None
    eps = {float(n.eps if sandwich else n.variance_epsilon) for n in norms}
    qk_eps = {float(n.eps) for n in qk}
    if len(eps) != 1 or len(qk_eps) > 1:
        return None
    return _LayerWeights(plan=plan, norms=tuple(n.weight for n in norms), qkv=qkv, o=o, gate_up=gate_up, down=down,
                         eps=eps.pop(), bf16=bf16, qk_norms=tuple(n.weight for n in qk),
                         qk_eps=qk_eps.pop() if qk_eps else 0.0, sandwich=sandwich)  # fmt: skip
