"""One decode step without transformers' per-call plumbing.

A decode step at batch 1 runs one token through every layer. Calling the model's `forward` for
it also builds causal masks, output records, keyword plumbing and the decorators around each
module call, which measured 5–10% of SmolLM2's step on a CPU, close to the machine's noise
(docs/performance.md, "Decode step"). `DecodeStep` runs the same modules in the same order, with
the same arithmetic, but calls them directly: the embedding, each layer's norms, projections,
RoPE (the model's own rotary embedding and `apply_rotary_pos_emb`), rocketkv's attention
function (`hf._attention`, so stage 2, the exact-attention path and `attention_mass` behave as
they do in `forward_tokens`), the MLP, the final norm and the LM head. Weight formats need
nothing special: their modules are the ones called. With weight-only int8 or bf16 linears, a
layer's q, k and v projections run as one joined linear, and so do its MLP's gate and up
(`_PackedLinear.join`: the same codes and arithmetic per output channel, one kernel call, the
input rounded once); the MLP is then `down(act(gate) · up)`, the formula of every supported
layout's MLP.

Only layouts whose layer order is read from the transformers source are built
(`SUPPORTED_STEP_TYPES`); any other model gets None from `decode_step_for` and the engine calls
`forward_tokens`. `tests/test_step.py` checks, for each supported architecture on a tiny model,
that the logits equal `forward_tokens`'s over several steps, exact attention and HSA.
"""

from __future__ import annotations

import sys
from typing import Any

import torch

from .hf import ModelShape, RocketCache, _attention

# Pre-norm layers: norm → attention → residual; norm → MLP → residual.
_PRE_NORM = ("llama", "mistral", "qwen2", "qwen3")
# Gemma 3: the attention's and the MLP's outputs are normed again before their residual add.
_SANDWICH = ("gemma3_text",)
SUPPORTED_STEP_TYPES = _PRE_NORM + _SANDWICH
# MLP classes whose forward is `down_proj(act_fn(gate_proj(x)) * up_proj(x))` (read from transformers).
_GATED_MLPS = ("LlamaMLP", "MistralMLP", "Qwen2MLP", "Qwen3MLP", "Gemma3MLP")


class DecodeStep:
    """`step(cache, input_ids [1, 1], positions [1]) → logits [1, V] float32` for one token.

    Built once per model by `decode_step_for`; holds references to the model's modules, no copies.
    Equals `forward_tokens(model, cache, input_ids, positions)` (same modules, same order).
    """

    def __init__(self, model: Any, shape: ModelShape):
        cfg = model.config
        self.model = model
        self.shape = shape
        self.sandwich = cfg.model_type in _SANDWICH
        self.layers = list(model.model.layers)
        self.layer_types: list[str] | None = list(cfg.layer_types) if self.sandwich else None
        self.softcap = getattr(cfg, "final_logit_softcapping", None)
        attn = self.layers[0].self_attn
        self.apply_rope = sys.modules[type(attn).__module__].apply_rotary_pos_emb
        self.qk_norm = hasattr(attn, "q_norm")
        # Per layer: the modules last joined and the joined linears (None: call them one by one).
        # Weight formats replace the linears after the step is built, so the join is redone
        # whenever the modules differ from those joined.
        self._joined: list[tuple[tuple[tuple[dict, str, Any], ...], Any, Any]] = []

    def _joins(self, i: int, layer: Any) -> tuple[Any, Any]:
        """Layer `i`'s joined q/k/v projection and its MLP run with a joined gate/up (each None when
        not joinable); built once, reused by every step."""
        if i < len(self._joined) and _unchanged(self._joined[i][0]):
            return self._joined[i][1], self._joined[i][2]
        attn, mlp = layer.self_attn, layer.mlp
        parts = (attn.q_proj, attn.k_proj, attn.v_proj, getattr(mlp, "gate_proj", None), getattr(mlp, "up_proj", None))
        with torch.inference_mode(False):  # the model's own tensors must not become inference tensors
            qkv = type(attn.q_proj).join(list(parts[:3])) if hasattr(type(attn.q_proj), "join") else None
            gate_up = None
            if parts[3] is not None and hasattr(mlp, "act_fn") and type(mlp).__name__ in _GATED_MLPS \
                    and hasattr(type(parts[3]), "join"):  # fmt: skip
                joined = type(parts[3]).join(list(parts[3:]))
                gate_up = None if joined is None else self._gated(mlp, joined)
        entry = (_watched(layer), qkv, gate_up)  # taken after the join: the parts now hold views of it
        if i < len(self._joined):
            self._joined[i] = entry
        else:
            self._joined.append(entry)
        return qkv, gate_up

    @torch.inference_mode()
    def __call__(self, cache: RocketCache, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        if input_ids.shape != (1, 1) or positions.shape != (1,):
            raise ValueError(f"a decode step takes input_ids [1, 1] and positions [1], got "
                             f"{tuple(input_ids.shape)}, {tuple(positions.shape)}")  # fmt: skip
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
            attn, spec = layer.self_attn, self.shape.layers[i]
            d = attn.head_dim
            qkv, gated_mlp = self._joins(i, layer)
            x = layer.input_layernorm(h)
            if qkv is None:
                q = attn.q_proj(x).view(1, 1, -1, d)  # [1, 1, H, D]
                k = attn.k_proj(x).view(1, 1, -1, d)  # [1, 1, Hkv, D]
                v = attn.v_proj(x).view(1, 1, -1, d).transpose(1, 2)  # [1, Hkv, 1, D]
            else:
                q, k, v = qkv(x).split([attn.q_proj.out_features, attn.k_proj.out_features,
                                        attn.v_proj.out_features], dim=-1)  # fmt: skip
                q, k = q.view(1, 1, -1, d), k.view(1, 1, -1, d)  # [1, 1, H|Hkv, D]
                v = v.view(1, 1, -1, d).transpose(1, 2)  # [1, Hkv, 1, D]
            if self.qk_norm:
                q, k = attn.q_norm(q), attn.k_norm(k)
            cos, sin = rope[None if self.layer_types is None else self.layer_types[i]]
            q, k = self.apply_rope(q.transpose(1, 2), k.transpose(1, 2), cos, sin)  # [1, H|Hkv, 1, D]
            keys, values = cache.update(k, v, i)  # [1, Hkv, L, D]
            out, _ = _attention(attn, q, keys, values, None, scaling=spec.scaling, sliding_window=spec.sliding_window)
            out = attn.o_proj(out.reshape(1, 1, -1))  # [1, 1, C]
            mlp = layer.mlp if gated_mlp is None else gated_mlp
            if self.sandwich:
                h = h + layer.post_attention_layernorm(out)
                h = h + layer.post_feedforward_layernorm(mlp(layer.pre_feedforward_layernorm(h)))
            else:
                h = h + out
                h = h + mlp(layer.post_attention_layernorm(h))
        logits = self.model.lm_head(inner.norm(h))[:, -1]  # [1, V]
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits.float()

    @staticmethod
    def _gated(mlp: Any, gate_up: Any) -> Any:
        """The MLP `down(act(gate(x)) · up(x))` with gate and up from one joined linear `[..., 2I]`."""
        n = mlp.gate_proj.out_features

        def run(x: torch.Tensor) -> torch.Tensor:
            gu = gate_up(x)  # [1, 1, 2I]
            return mlp.down_proj(mlp.act_fn(gu[..., :n]) * gu[..., n:])

        return run


def _watched(layer: Any) -> tuple[tuple[dict, str, Any], ...]:
    """What a layer's join depends on, as (dict, key, value) entries: its attention and MLP, their
    q/k/v and gate/up linears, and the tensors those hold. Weight formats replace the linears, and
    `model.to()` or a state-dict load replaces the tensors: a join made before would no longer be
    theirs. Read straight from the modules' dicts, so each step's check is cheap."""
    attn, mlp = layer._modules["self_attn"], layer._modules["mlp"]
    watched: list[tuple[dict, str, Any]] = [(layer._modules, "self_attn", attn), (layer._modules, "mlp", mlp)]
    for owner, name in ((attn, "q_proj"), (attn, "k_proj"), (attn, "v_proj"), (mlp, "gate_proj"), (mlp, "up_proj")):
        part = owner._modules.get(name)
        watched.append((owner._modules, name, part))
        if part is not None:
            watched += [(part._buffers, key, tensor) for key, tensor in part._buffers.items()]
    return tuple(watched)


def _unchanged(watched: tuple[tuple[dict, str, Any], ...]) -> bool:
    return all(where.get(key) is value for where, key, value in watched)


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
