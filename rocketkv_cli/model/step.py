"""One decode step without transformers' per-call plumbing.

A decode step at batch 1 runs one token through every layer. Calling the model's `forward` for
it also builds causal masks, output records, keyword plumbing and the decorators around each
module call, which measured 5–10% of SmolLM2's step on a CPU (docs/performance.md, "Decode
step"). `DecodeStep` runs the same modules in the same order, with the same arithmetic, but
calls them directly: the embedding, each layer's norms, projections, RoPE (the model's own
rotary embedding, applied element for element as transformers' `apply_rotary_pos_emb`), rocketkv's
attention function (`hf._attention`, so stage 2, the exact-attention path and `attention_mass`
behave as they do in `forward_tokens`), the MLP, the final norm and the LM head. Each module is
called through its `forward` (no `nn.Module.__call__`), a plain or bfloat16 linear through its
kernel (`_fast`). With weight-only int8 or bf16 linears, a layer's q, k and v projections run as
one joined linear, and so do its MLP's gate and up (`_PackedLinear.join`: the same codes and
arithmetic per output channel, one kernel call, the input rounded once); the MLP is then
`down(act(gate) · up)`, the formula of every supported layout's MLP.

Only layouts whose layer order is read from the transformers source are built
(`SUPPORTED_STEP_TYPES`); any other model gets None from `decode_step_for` and the engine calls
`forward_tokens`. `tests/test_step.py` checks, for each supported architecture on a tiny model,
that the logits equal `forward_tokens`'s over several steps, exact attention and HSA.
"""

from __future__ import annotations

import operator
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .hf import ModelShape, RocketCache, _attention, forward_tokens
from .linears import Bf16Linear, bf16_matvec, decode_step

# Pre-norm layers: norm → attention → residual; norm → MLP → residual.
_PRE_NORM = ("llama", "mistral", "qwen2", "qwen3")
# Gemma 3: the attention's and the MLP's outputs are normed again before their residual add.
_SANDWICH = ("gemma3_text",)
SUPPORTED_STEP_TYPES = _PRE_NORM + _SANDWICH
# MLP classes whose forward is `down_proj(act_fn(gate_proj(x)) * up_proj(x))` (read from transformers).
_GATED_MLPS = ("LlamaMLP", "MistralMLP", "Qwen2MLP", "Qwen3MLP", "Gemma3MLP")


Row = Callable[[torch.Tensor], torch.Tensor]  # one row `[1, 1, n]` → `[1, 1, m]`
Watched = tuple[tuple[dict, ...], tuple[str, ...], tuple[Any, ...], tuple[dict, ...], tuple[int, ...]]  # `_watched`


@dataclass(frozen=True)
class _LayerPlan:
    """What one layer's step calls, each taking and returning `[1, 1, n]` rows: its norms and its
    MLP, and its projections (`qkv` the joined q/k/v linear, None: `q`, `k`, `v` one by one), as
    `_fast` makes them. Built once per layer and kept while `watched` still holds."""

    watched: Watched
    norms: tuple[Row, ...]  # input, post-attention[, pre- and post-MLP]
    qkv: Row | None
    q: Row
    k: Row
    v: Row
    q_norm: Row | None
    k_norm: Row | None
    o: Row
    mlp: Row
    gate_up: Any  # the joined gate/up linear (None: not joined)
    qkv_linear: Any  # the joined q/k/v linear (None: not joined)
    direct: bool  # False: the modules themselves (hooks), called as the model's forward calls them
    sizes: tuple[int, int, int]  # q, k and v output features


class DecodeStep:
    """`step(cache, input_ids [1, 1], positions [1]) → logits [1, V] float32` for one token.

    Built once per model by `decode_step_for`; holds references to the model's modules, no copies.
    Equals `forward_tokens(model, cache, input_ids, positions)` inside `decode_step()` (same
    modules, same order, the same arithmetic), and runs inside `decode_step()` always: it is decode.

    Per layer it calls what `_LayerPlan` holds, not the modules themselves: each module's
    `forward` without `nn.Module.__call__`, a plain `nn.Linear` as `F.linear` and a bfloat16 one
    as its matrix-vector product, transformers' RMSNorms as `torch.rms_norm` on a CPU, and RoPE
    once over the joined q and k rows: a step of SmolLM2 runs ~100 small tensor operations per
    layer, and the calls around them add up (5–7% of a step: docs/performance.md, "A leaner
    decode step"). A layer whose norms, projections or MLP carry forward hooks or pre-hooks (or
    while global module hooks are set), or whose module has its own `forward` attribute or a
    compiled call, is run through module calls instead, unjoined, so that those run as the
    model's forward runs them; where the model, its decoder, a decoder layer or an attention
    module carries them (modules the step never calls), the step is the model's forward
    (`forward_tokens`).
    """

    def __init__(self, model: Any, shape: ModelShape):
        cfg = model.config
        self.model = model
        self.shape = shape
        self.sandwich = cfg.model_type in _SANDWICH
        self.layers = list(model.model.layers)
        self.layer_types: list[str] | None = list(cfg.layer_types) if self.sandwich else None
        self.softcap = getattr(cfg, "final_logit_softcapping", None)
        self.qk_norm = hasattr(self.layers[0].self_attn, "q_norm")
        self._plans: list[_LayerPlan] = []
        # the modules the step does not call: hooked, they take the decode back to the forward
        self._uncalled = [model, model.model, *self.layers, *(layer.self_attn for layer in self.layers)]

    def _plan(self, i: int, layer: Any) -> _LayerPlan:
        """Layer `i`'s plan, built on first use and again whenever a module or tensor it holds was
        replaced (weight formats replace the linears after the step is built; a state-dict load
        with `assign=True` or a conversion to another device replaces tensors) or hooks were added
        or removed: a plan keeps references to them. Parameters changed in place (`model.to()`
        keeps the `Parameter` objects and swaps their data) are read at each call."""
        if i < len(self._plans) and _unchanged(self._plans[i].watched):
            return self._plans[i]
        attn, mlp = layer.self_attn, layer.mlp
        parts = (attn.q_proj, attn.k_proj, attn.v_proj, getattr(mlp, "gate_proj", None), getattr(mlp, "up_proj", None))
        names: tuple[str, ...] = ("input_layernorm", "post_attention_layernorm")
        names += ("pre_feedforward_layernorm", "post_feedforward_layernorm") if self.sandwich else ()
        called = [getattr(layer, n) for n in names] + [attn.o_proj, mlp, *mlp.children()]
        called += [p for p in parts if p is not None] + ([attn.q_norm, attn.k_norm] if self.qk_norm else [])
        if _hooked(called):  # the modules themselves, as the model's forward calls them
            plan = _LayerPlan(
                watched=_watched(layer), norms=tuple(getattr(layer, n) for n in names), qkv=None,
                q=attn.q_proj, k=attn.k_proj, v=attn.v_proj, q_norm=attn.q_norm if self.qk_norm else None,
                k_norm=attn.k_norm if self.qk_norm else None, o=attn.o_proj, mlp=mlp, gate_up=None, qkv_linear=None,
                direct=False,
                sizes=(attn.q_proj.out_features, attn.k_proj.out_features, attn.v_proj.out_features),
            )  # fmt: skip
            return self._keep(i, plan)
        with torch.inference_mode(False):  # the model's own tensors must not become inference tensors
            qkv = type(attn.q_proj).join(list(parts[:3])) if hasattr(type(attn.q_proj), "join") else None
            gated = parts[3] is not None and hasattr(mlp, "act_fn") and type(mlp).__name__ in _GATED_MLPS
            gate_cls: Any = type(parts[3])
            gate_up = gate_cls.join(list(parts[3:])) if gated and hasattr(gate_cls, "join") else None
        if gate_up is not None:
            mlp_fn = _gated_joined(_fast(gate_up), mlp.act_fn.forward, _fast(mlp.down_proj), mlp.gate_proj.out_features)
        elif gated:
            mlp_fn = _gated(_fast(mlp.gate_proj), _fast(mlp.up_proj), mlp.act_fn.forward, _fast(mlp.down_proj))
        else:
            mlp_fn = mlp.forward
        plan = _LayerPlan(
            watched=_watched(layer),  # taken after the joins: the parts now hold views of them
            norms=tuple(_fast_norm(getattr(layer, n)) for n in names),
            qkv=None if qkv is None else _fast(qkv),
            q=_fast(attn.q_proj), k=_fast(attn.k_proj), v=_fast(attn.v_proj),
            q_norm=_fast_norm(attn.q_norm) if self.qk_norm else None,
            k_norm=_fast_norm(attn.k_norm) if self.qk_norm else None,
            o=_fast(attn.o_proj), mlp=mlp_fn, gate_up=gate_up, qkv_linear=qkv, direct=True,
            sizes=(attn.q_proj.out_features, attn.k_proj.out_features, attn.v_proj.out_features),
        )  # fmt: skip
        return self._keep(i, plan)

    def _keep(self, i: int, plan: _LayerPlan) -> _LayerPlan:
        if i < len(self._plans):
            self._plans[i] = plan
        else:
            self._plans.append(plan)
        return plan

    @torch.inference_mode()
    def __call__(self, cache: RocketCache, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        if input_ids.shape != (1, 1) or positions.shape != (1,):
            raise ValueError(f"a decode step takes input_ids [1, 1] and positions [1], got "
                             f"{tuple(input_ids.shape)}, {tuple(positions.shape)}")  # fmt: skip
        with decode_step():
            if _hooked(self._uncalled):
                return forward_tokens(self.model, cache, input_ids, positions)
            return self._step(cache, input_ids, positions)

    def _step(self, cache: RocketCache, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        inner = self.model.model
        cache.query_positions = positions
        h = inner.embed_tokens(input_ids)  # [1, 1, C]
        pos = positions.unsqueeze(0)  # [1, 1]
        rope: dict[str | None, Any]
        if self.layer_types is None:
            rope = {None: inner.rotary_emb(h, pos)}  # (cos, sin) [1, 1, D]
        else:
            rope = {t: inner.rotary_emb(h, pos, t) for t in set(self.layer_types)}
        for i, layer in enumerate(self.layers):
            p, spec = self._plan(i, layer), self.shape.layers[i]
            d = layer.self_attn.head_dim
            nq, nk, nv = p.sizes
            x = p.norms[0](h)
            cos, sin = rope[None if self.layer_types is None else self.layer_types[i]]
            if p.qkv is not None and p.q_norm is None:  # q and k side by side: RoPE once over both
                qkv = p.qkv(x)  # [1, 1, nq + nk + nv]
                qk = _rope(qkv[0, 0, : nq + nk].view(-1, d), cos[0], sin[0])  # [H + Hkv, D]
                q, k = qk[: nq // d].view(1, -1, 1, d), qk[nq // d :].view(1, -1, 1, d)  # [1, H|Hkv, 1, D]
                v = qkv[0, 0, nq + nk :].view(1, -1, 1, d)  # [1, Hkv, 1, D]
            else:
                if p.qkv is not None:
                    q, k, v = p.qkv(x).split([nq, nk, nv], dim=-1)
                else:
                    q, k, v = p.q(x), p.k(x), p.v(x)
                q, k = q.view(1, 1, -1, d), k.view(1, 1, -1, d)  # [1, 1, H|Hkv, D]
                if p.q_norm is not None and p.k_norm is not None:
                    q, k = p.q_norm(q), p.k_norm(k)
                q = _rope(q.reshape(-1, d), cos[0], sin[0]).view(1, -1, 1, d)  # [1, H, 1, D]
                k = _rope(k.reshape(-1, d), cos[0], sin[0]).view(1, -1, 1, d)  # [1, Hkv, 1, D]
                v = v.reshape(1, -1, 1, d)  # [1, Hkv, 1, D]
            keys, values = cache.update(k, v, i)  # [1, Hkv, L, D]
            out, _ = _attention(layer.self_attn, q, keys, values, None, scaling=spec.scaling,
                                sliding_window=spec.sliding_window)  # fmt: skip
            out = p.o(out.reshape(1, 1, -1))  # [1, 1, C]
            if self.sandwich:
                h = h + p.norms[1](out)
                h = h + p.norms[3](p.mlp(p.norms[2](h)))
            else:
                h = h + out
                h = h + p.mlp(p.norms[1](h))
        logits = self.model.lm_head(inner.norm(h))[:, -1]  # [1, V]
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits.float()


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE of rows `x` `[N, D]` at one position (cos, sin `[1, D]`): `x·cos + rotate_half(x)·sin`,
    transformers' `apply_rotary_pos_emb` element for element (RoFormer, Su et al., arXiv 2104.09864
    §3.4, in the half-split layout of the Llama family)."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[:, half:], x[:, :half]), dim=-1) * sin


def _fast(linear: Any) -> Row:
    """`linear` as a function of one row `[1, 1, in]` → `[1, 1, out]` with what its forward computes
    in a decode step, without the module call: a plain `nn.Linear` is `F.linear`; a bfloat16
    linear on a CPU is its matrix-vector product (`Bf16Linear._product` for one row); any other
    module is its own `forward`."""
    if type(linear) is nn.Linear:
        weight, bias = linear.weight, linear.bias
        return lambda x: F.linear(x, weight, bias)
    if type(linear) is Bf16Linear and linear.weight_bf16.device.type == "cpu":
        w, b, n = linear.weight_bf16, linear.bias, linear.out_features

        def row(x: torch.Tensor) -> torch.Tensor:
            y = bf16_matvec(w, x.view(-1).to(torch.bfloat16)).to(x.dtype)  # [out]
            return (y if b is None else y + b).view(1, 1, n)

        return row
    return linear.forward


# RMSNorms whose forward is w · (x · rsqrt(mean(x²) + ε)) for float32 x and w (read from transformers);
# Gemma 3's multiplies by (1 + w) instead.
_RMS_NORMS = ("LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm")
_RMS_NORMS_PLUS_ONE = ("Gemma3RMSNorm",)


def rms_norm_kind(norm: Any) -> str | None:
    """ "w" for transformers' own RMSNorm of `w · x/rms(x)` (Llama, Mistral, Qwen), "1+w" for
    Gemma 3's `(1 + w) · x/rms(x)`, None for any other norm (another class, or one whose
    `forward` a subclass replaced): what `torch.rms_norm` can stand for."""
    cls = type(norm)
    own = cls.__module__.startswith("transformers.models.") and cls.forward.__qualname__ == f"{cls.__name__}.forward"
    if not own:
        return None
    return "w" if cls.__name__ in _RMS_NORMS else "1+w" if cls.__name__ in _RMS_NORMS_PLUS_ONE else None


def _fast_norm(norm: Any) -> Row:
    """`norm` as a function of float32 rows on a CPU: transformers' RMSNorms as `torch.rms_norm`,
    whose CPU path is the same operations (x², mean, + ε, rsqrt, ·x, ·weight): equal bit for bit
    (`tests/test_step.py`); another input dtype or device (a GPU's fused kernel sums in its own
    order), and any other norm, through its own `forward` (Llama's norm computes a float64 input
    in float32, for one)."""
    kind = rms_norm_kind(norm)
    if kind is None:
        return norm.forward
    forward, weight, f32 = norm.forward, norm.weight, torch.float32
    shape = (weight.shape[0],)
    plus_one = kind == "1+w"
    eps = norm.eps if plus_one else norm.variance_epsilon

    def run(x: torch.Tensor) -> torch.Tensor:
        if x.dtype != f32 or weight.dtype != f32 or x.device.type != "cpu":
            return forward(x)
        return torch.rms_norm(x, shape, 1.0 + weight if plus_one else weight, eps)  # Gemma: (1 + w), as its forward

    return run


def _gated_joined(gate_up: Row, act: Row, down: Row, n: int) -> Row:
    """The MLP `down(act(gate(x)) · up(x))` with gate and up from one joined linear `[1, 1, 2I]`."""

    def run(x: torch.Tensor) -> torch.Tensor:
        gu = gate_up(x)  # [1, 1, 2I]
        return down(act(gu[..., :n]) * gu[..., n:])

    return run


def _gated(gate: Row, up: Row, act: Row, down: Row) -> Row:
    """The MLP `down(act(gate(x)) · up(x))` from its three linears."""
    return lambda x: down(act(gate(x)) * up(x))


def _hooked(modules: list[Any]) -> bool:
    """Whether calling `modules` by their `forward` would skip something their `__call__` runs:
    forward hooks or pre-hooks, global module hooks, a `forward` set on the instance, or a
    compiled call (`module.compile()`)."""
    glob = nn.modules.module
    return bool(glob._global_forward_hooks or glob._global_forward_pre_hooks) or any(
        m._forward_hooks or m._forward_pre_hooks or "forward" in vars(m) or m._compiled_call_impl is not None
        for m in modules
    )


def _watched(layer: Any) -> Watched:
    """What a layer's plan depends on: every module of the layer and the parameters and buffers
    each holds, as (dicts, keys, values); and the size of every hook dict of the layer's modules
    and of the global ones, as (dicts, sizes). Read straight from the modules' dicts, so each
    step's check is cheap."""
    modules = list(layer.modules())
    entries = [
        (where, key, value)
        for module in modules
        for where in (module._modules, module._parameters, module._buffers)
        for key, value in where.items()
    ]
    entries += [(vars(module), "forward", vars(module).get("forward")) for module in modules]  # an instance forward
    wheres, keys, values = zip(*entries, strict=True)
    glob = nn.modules.module
    hooks = [glob._global_forward_hooks, glob._global_forward_pre_hooks]
    hooks += [d for m in modules for d in (m._forward_hooks, m._forward_pre_hooks, vars(m))]
    return wheres, keys, values, tuple(hooks), tuple(len(d) for d in hooks)


def _unchanged(watched: Watched) -> bool:
    wheres, keys, values, hooks, sizes = watched
    return all(map(operator.is_, map(dict.get, wheres, keys), values)) and all(map(operator.eq, map(len, hooks), sizes))


def decode_step_for(model: Any, shape: ModelShape) -> DecodeStep | None:
    """A `DecodeStep` for `model`, or None when its architecture's layer layout is not one this
    module reproduces, or its code is not transformers' own (`--trust-remote-code`): the caller
    then runs the model's own forward."""
    if shape.model_type not in SUPPORTED_STEP_TYPES or not type(model).__module__.startswith("transformers.models."):
        return None  # another layout, or remote code that only borrows a supported name
    layer = model.model.layers[0]
    needed = ["input_layernorm", "mlp", "self_attn"]
    needed += ["post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm"] \
        if shape.model_type in _SANDWICH else ["post_attention_layernorm"]  # fmt: skip
    attn = layer.self_attn
    if not all(hasattr(layer, n) for n in needed) or not all(
        hasattr(attn, n) for n in ("q_proj", "k_proj", "v_proj", "o_proj", "head_dim")
    ):
        return None
    if not hasattr(sys.modules[type(attn).__module__], "apply_rotary_pos_emb"):
        return None
    return DecodeStep(model, shape)
