"""Where int4's error lives, and which layouts of the same size remove it (docs/storage.md, "Ablation").

For each document (the storage report's: KJV with a planted fact, five questions), one prefill is
compressed at the default budget into a float32 cache (kept as a `.kv` file under --scratch, so a
rerun skips the prefill), the float32 cache's greedy answers are the reference, and each layout
below is scored teacher-forced against them as `scripts/storage_report.py` scores storage types:
top-1 agreement per answer token and mean KL(float32 ‖ layout), HSA at every step as in decode.
A layout is a way to round the float32 cache's keys and values, applied in memory:

- storage types (`int4`, `int8`, `int4+rope`, group sizes, sink counts) use `core.quant` itself;
- `*-only` layouts round part of the cache (keys, values, full-attention or sliding-window layers)
  as int4 and keep the rest exact, to locate the error;
- `sim:` layouts are not storage types: quantizers written here (per-token key groups, MSE-chosen
  clipping, 8-bit group ranges, float16 recent tokens) to test an idea before building it into
  the format (the table's descriptions say what each would cost in bytes); `sim: PCA, …` rotates
  keys (before RoPE) and values into principal components, calibrated once on the GPL
  (`calibration_bases`) or fitted to the cache itself, the bound of a stored basis.

Beside the layouts, the order-0 entropy of each document's int4 codes (`code_entropy`): what an
entropy coder of the codes could save at best.

Resumable: finished (document, layout) results are kept in the JSON.

    python scripts/storage_ablation.py                     # gemma-3-270m at 32000 tokens, 2 documents
    python scripts/storage_ablation.py --from-json         # only rewrite docs/storage.md
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
from storage_report import DATA, OPEN_QUESTIONS  # noqa: E402

CLIP_FACTORS = (1.0, 0.95, 0.9, 0.85, 0.8)  # shrink factors of a group's range tried by the MSE search

LAYOUTS = {  # name: what it is (and, for a layout int4's bytes would not hold, what it costs)
    "int8": "int8 everywhere (the Gemma default)",
    "int4": "int4 everywhere (64-token key groups, 64-dim value groups, 4 float16 sinks)",
    "int4 keys only": "keys int4, values exact",
    "int4 values only": "values int4, keys exact",
    "int4 full-attention layers only": "int4 in the 3 full-attention layers, sliding-window layers exact",
    "int4 sliding-window layers only": "int4 in the 15 sliding-window layers, full-attention layers exact",
    "int4, sliding keys int8": "int4, but the sliding-window layers' keys int8 (+44% bytes per sliding token)",
    "int4, key groups 32": "int4 with 32-token key groups (+6% bytes per token)",
    "int4, key groups 16": "int4 with 16-token key groups (+17% bytes per token)",
    "int4, 16 sinks": "int4 with each head's first 16 tokens in float16 (+12 float16 tokens per head and layer)",
    "int4+rope": "int4 with keys quantized before RoPE, every layer",
    "int4+rope sliding only": "int4; keys before RoPE in the sliding-window layers only",
    "sim: recent 16 in float16": "int4, and each head's last 16 stored tokens in float16 (+16 float16 tokens)",
    "sim: MSE clipping": "int4 with each group's range shrunk by the factor of least squared error",
    "sim: key groups 32, 8-bit ranges": "int4, 32-token key groups whose min/max are 8-bit codes in the "
    "channel's range (int4's bytes)",
    "sim: sliding keys per token (64 dims)": "int4; sliding-window keys grouped per token like values",
    "sim: key bits by query energy": "int4's bytes; each key channel gets 2–6 or 8 bits (4 on average per head), "
    "chosen to minimise Σ E[q_c²]·range_c²/(2^b−1)² with E[q_c²] from the document's last 32 queries "
    "(+1 byte per channel and head)",
    "sim: key and value bits by energy": "the row above, and each value channel 2–6 or 8 bits (4 on average per head) "
    "by Σ_h ‖W_o[:, h, c]‖² over the head's GQA group times the token groups' mean range²",
    "sim: PCA, calibrated basis": "int4's bytes; keys before RoPE and values each rotated into the model's "
    "principal components (calibrated once on another text, the GPL; not stored in the file), each component "
    "0 or 2–8 bits in 64-token groups, allocated by its weighted mean squared error (KVTC, arXiv 2511.01815 §3)",
    "sim: PCA, own basis": "the row above with each layer's basis taken from the cache's own tokens "
    "(fitted in-sample; a D×D basis per layer and head would have to be stored)",
}
ALLOC_BITS = (2, 3, 4, 5, 6, 8)  # the widths "sim: key bits by query energy" may give a channel
PCA_BITS = (0, 2, 3, 4, 5, 6, 7, 8)  # the widths a principal component may get (0: not stored, its mean)


def projection_outputs(engine, ids: list[int], names: tuple[str, ...]) -> dict[tuple[int, str], object]:
    """Outputs `[S, H·D]` of each attention block's projections `names` (e.g. "q_proj") during an
    exact forward of `ids`, keyed by (layer, name): forward hooks, an experiment's instrument
    coupled to the presets' transformers modules."""
    import torch

    from rocketkv_cli.model.hf import empty_cache, rocketkv_attention

    model, shape = engine.model, engine.shape
    blocks = [m for m in model.modules() if hasattr(m, "layer_idx") and all(hasattr(m, n) for n in names)]
    rows: dict[tuple[int, str], list] = {}
    hooks = [getattr(b, name).register_forward_hook(
                 lambda m, i, o, key=(b.layer_idx, name): rows.setdefault(key, []).append(o[0]))
             for b in blocks for name in names]  # fmt: skip
    try:
        cache = empty_cache(model, shape, len(ids))
        with torch.no_grad(), rocketkv_attention(model, cache, shape):
            engine._prefill_chunks(cache, ids, 0, 1024, lambda done, total: None)
    finally:
        for h in hooks:
            h.remove()
    return {key: torch.cat(parts, 0).float() for key, parts in rows.items()}


def attention_blocks(engine) -> list:
    """The model's attention blocks (modules with a `layer_idx` and `q_proj`), by layer."""
    blocks = (m for m in engine.model.modules() if hasattr(m, "q_proj") and hasattr(m, "layer_idx"))
    return sorted(blocks, key=lambda b: b.layer_idx)


def principal_components(x) -> tuple:
    """(mean `[Hkv, D]`, basis `[Hkv, D, D]`, columns by falling variance) of `x` `[Hkv, S, D]`, float32."""
    import torch

    x = x.double()
    mean = x.mean(1)
    cov = (x - mean[:, None]).transpose(1, 2) @ (x - mean[:, None]) / max(1, x.shape[1])
    return mean.float(), torch.linalg.eigh(cov)[1].flip(-1).float()  # eigh: ascending


def calibration_bases(engine, ids: list[int], skip: int = 4) -> list:
    """Per layer (key mean `[Hkv, D]`, key basis `[Hkv, D, D]`, value mean, value basis): the
    principal components of the pre-RoPE keys (after the key norm) and the values of an exact
    forward of `ids`, its first `skip` tokens (the sinks) left out."""
    import torch

    shape = engine.shape
    rows = projection_outputs(engine, ids, ("k_proj", "v_proj"))
    out = []
    for b in attention_blocks(engine):
        parts: tuple = ()
        for name in ("k_proj", "v_proj"):
            x = rows[(b.layer_idx, name)][skip:].view(-1, shape.n_kv_heads, shape.head_dim)  # [S, Hkv, D]
            if name == "k_proj" and hasattr(b, "k_norm"):
                with torch.no_grad():
                    x = b.k_norm(x).float()
            parts += principal_components(x.transpose(0, 1))
        out.append(parts)
    return out


def code_entropy(engine, cache) -> dict:
    """Order-0 entropy of the cache's int4 codes, in bits per code, one symbol table per layer and
    channel (what a per-channel entropy coder of the codes could reach at best, before its tables):
    {"keys": …, "values": …, "codes": n}, pooled over every layer."""
    import torch

    from rocketkv_cli.core.quant import KVStorage, _unpack4

    storage = KVStorage.parse("int4")
    bits = {"keys": 0.0, "values": 0.0}
    n = 0
    for i, layer in enumerate(cache.layers):
        parts = layer.to_storage(storage, engine.rope_freqs[i]).stored
        for name in bits:
            codes = _unpack4(parts[f"{name}.q"]).long()  # [Hkv, S, D]
            counts = torch.nn.functional.one_hot(codes, 16).sum(1).double()  # [Hkv, D, 16]
            p = counts / counts.sum(-1, keepdim=True)
            bits[name] += float(-(counts * torch.where(p > 0, p.log2(), 0.0)).sum())
        n += codes.numel()
    return {"keys": bits["keys"] / n, "values": bits["values"] / n, "codes": n}


def pca_round(c, weight, budget: float = 4.5, group: int = 64):
    """Components `[Hkv, S, N]` rounded per component in groups of `group` tokens, each component
    0–8 bits (`PCA_BITS`): the Lagrangian choice minimising Σ weight_j · err_j(b) with err(0) =
    mean c_j² (not stored: 0, the calibration mean) and err(b) = mean_g range² / (12·(2^b−1)²),
    at b + 32/group bits per token (codes and two float16 range values per group) and ≤ `budget`
    bits per token and component on average (int4's 4 + 0.5)."""
    import torch

    hkv, s, d = c.shape
    n = -(-s // group)
    x = torch.cat([c, c[:, -1:].expand(hkv, n * group - s, d)], 1) if n * group > s else c
    g = x.view(hkv, n, group, d)
    r2 = ((g.amax(2) - g.amin(2)) ** 2).mean(1).double()  # [Hkv, N]
    widths = torch.tensor(PCA_BITS, dtype=torch.float64)
    cost = torch.where(widths > 0, widths + 32 / group, 0.0)
    err = torch.where(widths > 0, 1 / (12 * (2**widths - 1) ** 2), 0.0)  # × range²
    bits = torch.empty(hkv, d, dtype=torch.long)
    for h in range(hkv):
        unstored = (c[h].double() ** 2).mean(0)[:, None]  # [N, 1]: the error of a component left at 0 bits
        e = weight[h].double()[:, None] * torch.where(widths > 0, r2[h][:, None] * err, unstored)
        top = float(e.max()) or 1.0
        e = e / top
        lo, hi = 0.0, 1.0
        for _ in range(60):
            lam = (lo + hi) / 2
            if float(cost[(e + lam * cost).argmin(-1)].sum()) > budget * d:
                lo = lam
            else:
                hi = lam
        bits[h] = widths[(e + hi * cost).argmin(-1)].long()
    out = key_groups_bits(c, bits.clamp_min(1))
    return torch.where((bits > 0)[:, None, :], out, torch.zeros_like(out)), bits


def pca_layer(layer, freqs, basis, key_w, value_w, sinks: int = 4):
    """A float32 `LayerKV` as `sim: PCA …` would store it: sinks in float16; the other tokens' keys
    un-RoPEd, centred and rotated into `basis`'s key components, values into its value
    components, each rounded by `pca_round` and rotated back."""
    import torch

    from rocketkv_cli.core.cache import LayerKV
    from rocketkv_cli.core.quant import rope_rotate

    k, v, pos = layer.keys[0].float(), layer.values[0].float(), layer.positions[0]
    a = min(sinks, k.shape[1])
    kk, vv = k.half().float(), v.half().float()
    if a == k.shape[1]:
        return LayerKV(kk.unsqueeze(0), vv.unsqueeze(0), layer.positions)
    kp = rope_rotate(k[:, a:], pos[:, a:], freqs.float(), inverse=True) if freqs is not None else k[:, a:]
    km, kb, vm, vb = basis
    half = key_w.shape[-1] // 2
    pair = (key_w[:, :half] + key_w[:, half:]) / 2
    wk = (kb**2 * torch.cat([pair, pair], -1)[:, :, None]).sum(1)  # [Hkv, D] per component
    wv = (vb**2 * value_w[:, :, None]).sum(1)
    ck, _ = pca_round((kp - km[:, None]) @ kb, wk)
    kh = ck @ kb.transpose(1, 2) + km[:, None]
    kk[:, a:] = rope_rotate(kh, pos[:, a:], freqs.float(), inverse=False) if freqs is not None else kh
    cv, _ = pca_round((v[:, a:] - vm[:, None]) @ vb, wv)
    vv[:, a:] = cv @ vb.transpose(1, 2) + vm[:, None]
    return LayerKV(kk.unsqueeze(0), vv.unsqueeze(0), layer.positions)


def own_basis(layer, freqs, sinks: int = 4):
    """`calibration_bases`'s tuple for one layer from its own kept tokens (after the sinks)."""

    from rocketkv_cli.core.quant import rope_rotate

    k, v, pos = layer.keys[0].float(), layer.values[0].float(), layer.positions[0]
    a = min(sinks, k.shape[1])
    kp = rope_rotate(k[:, a:], pos[:, a:], freqs.float(), inverse=True) if freqs is not None else k[:, a:]
    return principal_components(kp) + principal_components(v[:, a:])


def tail_query_energy(engine, ids: list[int], window: int = 32) -> list:
    """Per layer, E[q_c²] `[Hkv, D]` float32 of the queries of the last `window` document tokens,
    after the layer's query norm and RoPE (the basis the keys are stored in), averaged over each
    KV head's GQA group. Captured with forward hooks on each attention block's `q_proj` during an
    exact forward of the document: an experiment's instrument, coupled to the two presets'
    transformers modules (Llama: no query norm; Gemma 3: `q_norm`)."""
    import torch

    from rocketkv_cli.core.quant import rope_rotate

    shape = engine.shape
    rows = projection_outputs(engine, ids, ("q_proj",))
    out = []
    for b in attention_blocks(engine):
        i = b.layer_idx
        q = rows[(i, "q_proj")][-window:]  # [W, H·D]
        h, d = q.shape[1] // shape.head_dim, shape.head_dim
        q = q.view(-1, h, d)
        if hasattr(b, "q_norm"):
            with torch.no_grad():
                q = b.q_norm(q).float()
        q = q.transpose(0, 1)  # [H, W, D]
        if engine.rope_freqs[i] is not None:
            pos = torch.arange(len(ids) - q.shape[1], len(ids)).expand(h, -1)
            q = rope_rotate(q, pos, engine.rope_freqs[i].float(), inverse=False)
        hkv = shape.n_kv_heads
        out.append((q**2).view(hkv, h // hkv, -1, d).mean((1, 2)))
    return out


def value_channel_energy(engine) -> list:
    """Per layer, Σ over each KV head's GQA group of ‖W_o[:, h·D + c]‖² `[Hkv, D]` float32: how
    much a value channel's rounding error reaches the layer's output."""
    shape = engine.shape
    blocks = sorted((m for m in engine.model.modules() if hasattr(m, "o_proj") and hasattr(m, "layer_idx")),
                    key=lambda b: b.layer_idx)  # fmt: skip
    out = []
    for b in blocks:
        w = b.o_proj.weight.detach().float()  # [hidden, H·D]
        h = w.shape[1] // shape.head_dim
        energy = (w**2).sum(0).view(h, shape.head_dim)
        out.append(energy.view(shape.n_kv_heads, h // shape.n_kv_heads, shape.head_dim).sum(1))
    return out


def lagrangian_bits(importance, average: int = 4):
    """Bits `[Hkv, N]` (each in ALLOC_BITS, mean ≤ `average` per row) minimising
    Σ importance / (2^b − 1)² `[Hkv, N]`: bisection on the multiplier of the bit budget."""
    import torch

    importance = importance.double()
    widths = torch.tensor(ALLOC_BITS, dtype=torch.float64)
    err = 1 / (2**widths - 1) ** 2
    out = torch.empty(importance.shape, dtype=torch.long)
    for row in range(importance.shape[0]):
        lo, hi = 1e-30, 1e30
        for _ in range(120):
            lam = (lo * hi) ** 0.5
            b = widths[(importance[row, :, None] * err + lam * widths).argmin(-1)]
            lo, hi = (lam, hi) if b.mean() > average else (lo, lam)
        out[row] = widths[(importance[row, :, None] * err + hi * widths).argmin(-1)].long()
    return out


def value_bits(values, weight, group: int = 64):
    """Bits per value channel `[Hkv, D]` for per-token groups of `group` channels: importance
    weight_c × the mean over tokens of its group's range²."""
    hkv, s, d = values.shape
    g = values.view(hkv, s, d // group, group)
    r2 = ((g.amax(-1) - g.amin(-1)) ** 2).mean(1)  # [Hkv, D/group]
    return lagrangian_bits(weight * r2.repeat_interleave(group, -1))


def token_groups_bits(x, bits, group: int = 64):
    """Values `[Hkv, S, D]` rounded per token in groups of `group` channels, channel c with bits `[Hkv, D]`."""
    hkv, s, d = x.shape
    g = x.view(hkv, s, d // group, group)
    lo, hi = g.amin(-1, keepdim=True), g.amax(-1, keepdim=True)
    step = ((hi - lo) / (2.0 ** bits.float() - 1).view(hkv, 1, d // group, group)).clamp_min(1e-30)
    return ((g - lo) / step).round().mul(step).add(lo).minimum(hi).view(hkv, s, d)


def allocated_key_bits(keys, weight, group: int = 64, average: int = 4):
    """Bits per key channel `[Hkv, D]` (each in ALLOC_BITS, mean ≤ `average` per head): the
    Lagrangian solution of min Σ_c weight_c · mean_g range_cg² / (2^b_c − 1)² — uniform rounding
    error of a channel's token group is range²/(12·(2^b−1)²), and a logit's error is Σ_c q_c·Δk_c
    (reverse water-filling over channels, as in transform coding; KVTC, arXiv 2511.01815 §3)."""
    import torch

    hkv, s, d = keys.shape
    n = -(-s // group)
    x = torch.cat([keys, keys[:, -1:].expand(hkv, n * group - s, d)], 1) if n * group > s else keys
    g = x.view(hkv, n, group, d)
    importance = (weight * ((g.amax(2) - g.amin(2)) ** 2).mean(1)).double()  # [Hkv, D]
    return lagrangian_bits(importance, average)


def key_groups_bits(k, bits, g: int = 64):
    """Keys `[Hkv, S, D]` rounded per channel in groups of g tokens, channel c with bits `[Hkv, D]`."""
    import torch

    hkv, s, d = k.shape
    n = -(-s // g)
    x = torch.cat([k, k[:, -1:].expand(hkv, n * g - s, d)], 1) if n * g > s else k
    grp = x.view(hkv, n, g, d)
    lo, hi = grp.amin(2, keepdim=True), grp.amax(2, keepdim=True)
    step = ((hi - lo) / (2.0 ** bits.float() - 1).view(hkv, 1, 1, d)).clamp_min(1e-30)
    xh = torch.minimum(((grp - lo) / step).round() * step + lo, hi)
    return xh.view(hkv, n * g, d)[:, :s]


def simulated_groups(x, bits: int, clip: tuple[float, ...] = (), ranges8: bool = False):
    """Round `x` `[..., G, E]` in groups of its last dim (asymmetric, as `core.quant` does), with
    an MSE-chosen clipping of each group's range, or with each group's min/max rounded outward to
    8-bit codes of the range over dim -2 (what one per-channel float pair would store)."""
    import torch

    levels = (1 << bits) - 1
    lo, hi = x.amin(-1), x.amax(-1)
    if ranges8:
        glo, ghi = lo.amin(dim=-2, keepdim=True), hi.amax(dim=-2, keepdim=True)
        span = (ghi - glo).clamp_min(1e-30)
        lo = torch.floor((lo - glo) / span * 255) / 255 * span + glo
        hi = torch.ceil((hi - glo) / span * 255) / 255 * span + glo
    best, best_err = None, None
    for f in clip or (1.0,):
        mid = (lo + hi) / 2
        a, b = mid + (lo - mid) * f, mid + (hi - mid) * f
        step = ((b - a) / levels).clamp_min(1e-30).unsqueeze(-1)
        xh = ((x - a.unsqueeze(-1)) / step).round().clamp(0, levels) * step + a.unsqueeze(-1)
        err = ((xh - x) ** 2).sum(-1)
        if best is None or best_err is None:
            best, best_err = xh, err
        else:
            best = torch.where((err < best_err).unsqueeze(-1), xh, best)
            best_err = torch.minimum(err, best_err)
    return best


def key_groups(k, g: int, **kw):
    """Keys `[Hkv, S, D]` rounded per channel in groups of g tokens (`simulated_groups`)."""
    import torch

    hkv, s, d = k.shape
    n = -(-s // g)
    x = torch.cat([k, k[:, -1:].expand(hkv, n * g - s, d)], 1) if n * g > s else k
    out = simulated_groups(x.view(hkv, n, g, d).transpose(2, 3), 4, **kw)  # [Hkv, G, D, g]
    return out.transpose(2, 3).reshape(hkv, n * g, d)[:, :s]


def token_groups(x, g: int, **kw):
    """Keys or values `[Hkv, S, D]` rounded per token in groups of g channels."""
    hkv, s, d = x.shape
    return simulated_groups(x.view(hkv, s, d // g, g), 4, **kw).reshape(hkv, s, d)


def layouts(engine, energy: list | None = None, bases: list | None = None) -> dict[str, Callable]:
    """name → f(layer, i) giving the layer as that layout holds it (float32 `LayerKV`). energy:
    per layer E[q_c²] `[Hkv, D]` (`tail_query_energy`), for the bit-allocation layout."""
    from rocketkv_cli.core.cache import LayerKV
    from rocketkv_cli.core.quant import KVStorage

    full = {i for i, s in enumerate(engine.shape.layers) if s.sliding_window is None}

    def st(name: str, **kw):
        storage = KVStorage.parse(name) if not kw else KVStorage(name, **kw)
        return lambda layer, i: layer.to_storage(storage, engine.rope_freqs[i])

    int4, int8, rope = st("int4"), st("int8"), st("int4+rope")
    out_energy = value_channel_energy(engine)

    def sim(keys=None, values=None, sinks=4, recent=0, where=lambda i: True):
        def f(layer, i):
            if not where(i):
                return int4(layer, i)
            k, v = layer.keys[0].float(), layer.values[0].float()
            a = min(sinks, k.shape[1])
            b = max(a, k.shape[1] - recent)
            kk, vv = k.half().float(), v.half().float()  # sinks and recent tokens: float16
            kk[:, a:b] = (keys or (lambda x: key_groups(x, 64)))(k[:, a:b])
            vv[:, a:b] = (values or (lambda x: token_groups(x, 64)))(v[:, a:b])
            return LayerKV(kk.unsqueeze(0), vv.unsqueeze(0), layer.positions)

        return f

    def mix(keys, values):
        return lambda layer, i: LayerKV(keys(layer, i).keys, values(layer, i).values, layer.positions)

    def pca(layer, i, basis):
        if energy is None:
            raise ValueError("the PCA layouts weigh key components by the query energy: pass it")
        return pca_layer(layer, engine.rope_freqs[i], basis, energy[i], out_energy[i])

    exact = lambda layer, i: layer  # noqa: E731
    clip = {"clip": CLIP_FACTORS}
    return {
        "int8": int8,
        "int4": int4,
        "int4 keys only": mix(int4, exact),
        "int4 values only": mix(exact, int4),
        "int4 full-attention layers only": lambda layer, i: int4(layer, i) if i in full else layer,
        "int4 sliding-window layers only": lambda layer, i: layer if i in full else int4(layer, i),
        "int4, sliding keys int8": lambda layer, i: int4(layer, i) if i in full else mix(int8, int4)(layer, i),
        "int4, key groups 32": st("int4", key_group_tokens=32),
        "int4, key groups 16": st("int4", key_group_tokens=16),
        "int4, 16 sinks": st("int4", sink_tokens=16),
        "int4+rope": rope,
        "int4+rope sliding only": lambda layer, i: int4(layer, i) if i in full else rope(layer, i),
        "sim: recent 16 in float16": sim(recent=16),
        "sim: MSE clipping": sim(lambda x: key_groups(x, 64, **clip), lambda x: token_groups(x, 64, **clip)),
        "sim: key groups 32, 8-bit ranges": sim(lambda x: key_groups(x, 32, ranges8=True)),
        "sim: sliding keys per token (64 dims)": sim(lambda x: token_groups(x, 64), where=lambda i: i not in full),
        "sim: key bits by query energy": lambda layer, i: sim(
            lambda x: key_groups_bits(x, allocated_key_bits(x, energy[i]))
        )(layer, i),  # type: ignore[index]
        "sim: key and value bits by energy": lambda layer, i: sim(
            lambda x: key_groups_bits(x, allocated_key_bits(x, energy[i])),  # type: ignore[index]
            lambda x: token_groups_bits(x, value_bits(x, out_energy[i])),
        )(layer, i),
        "sim: PCA, calibrated basis": lambda layer, i: pca(layer, i, (bases or [])[i]),
        "sim: PCA, own basis": lambda layer, i: pca(layer, i, own_basis(layer, engine.rope_freqs[i])),
    }


def run(args) -> dict:
    import torch

    from rocketkv_cli.api.rocketkv import RocketKV
    from rocketkv_cli.core.config import PrefillConfig, with_preset_defaults
    from rocketkv_cli.core.quant import KVStorage
    from rocketkv_cli.engine.answer import answer, decode_config_for, prepare_questions
    from rocketkv_cli.engine.documents import Document, read_document
    from rocketkv_cli.eval.storage import teacher_forced_log_probs
    from rocketkv_cli.eval.tasks import generate
    from rocketkv_cli.store.format import load_cache, save_cache

    torch.set_num_threads(args.threads)
    report = json.loads(args.json.read_text()) if args.json.exists() else {}
    report.setdefault("results", {})
    report["layouts"] = LAYOUTS
    engine = RocketKV.load(args.preset, device="cpu", weights="float").engine  # storage alone varies
    shape = engine.shape
    report["shape"] = {"n_layers": len(shape.layers), "n_kv_heads": shape.n_kv_heads, "head_dim": shape.head_dim}
    cfg = with_preset_defaults(PrefillConfig(), args.preset, set())
    count = lambda text: len(engine.tokenizer(text, add_special_tokens=False)["input_ids"])  # noqa: E731
    haystack = read_document(str(DATA / "kjv.txt")).text
    args.scratch.mkdir(parents=True, exist_ok=True)
    for index in range(args.samples):
        key = f"{args.preset}/{args.length}/{index}"
        done = report["results"].setdefault(key, {})
        wanted = [n for n in LAYOUTS if not args.only or n in args.only]
        if all(name in done for name in wanted) and key in report.get("entropy", {}):
            continue
        sample = generate("niah_text", index, 7, args.length - 200, count, haystack)
        questions = [q.text for q in sample.questions] + OPEN_QUESTIONS
        path = args.scratch / f"{args.preset}-{args.length}-{index}-float32.kv"
        energy_path = path.with_suffix(".energy.pt")
        if not energy_path.exists():
            doc = Document(sample.document, f"{index:064x}", f"kjv-{args.length}-{index}")
            torch.save(tail_query_energy(engine, engine.document_tokens(doc).ids), energy_path)
        bases_path = args.scratch / f"{args.preset}-calibration-bases.pt"
        if not bases_path.exists():
            calib = read_document(str(DATA / "gpl-3.txt")).text
            torch.save(calibration_bases(engine, engine.tokenizer(calib)["input_ids"]), bases_path)
        bases = torch.load(bases_path)
        todo = {k: f for k, f in layouts(engine, torch.load(energy_path), bases).items() if k in wanted}
        if not path.exists():
            t0 = time.perf_counter()
            doc = Document(sample.document, f"{index:064x}", f"kjv-{args.length}-{index}")
            tokens = engine.document_tokens(doc)
            prefill = engine.prefill(tokens.ids, cfg.window_size, cfg.observation == "probe", cfg.chunk_tokens,
                                     reconstruct=cfg.observation == "reconstruct")  # fmt: skip
            cache = engine.compress(prefill, cfg, doc.sha256, doc.source, storage=KVStorage("float32"), tokens=tokens)
            save_cache(cache, path, force=True)
            print(f"{key}: prefill + compress {time.perf_counter() - t0:.0f}s", file=sys.stderr)
        cache = load_cache(path)
        cache = cache.with_layers(tuple(cache.layers))  # read every layer once
        if key not in report.setdefault("entropy", {}):
            report["entropy"][key] = code_entropy(engine, cache)
            args.json.write_text(json.dumps(report, indent=1))
        if all(name in done for name in wanted):
            continue
        refs = list(answer(engine, cache, questions, 32, decode_config_for(cache)))
        prepared = prepare_questions(engine, cache, questions, 32)
        ref_lp = [teacher_forced_log_probs(engine, cache, ids, r.token_ids) for (_, ids), r in zip(prepared, refs)]
        for name, layout in todo.items():
            if name in done:
                continue
            t0 = time.perf_counter()
            variant = cache.with_layers(tuple(layout(layer, i) for i, layer in enumerate(cache.layers)))
            same = steps = 0
            kl = 0.0
            for (_, ids), ref, ref_log_probs in zip(prepared, refs, ref_lp):
                lp = teacher_forced_log_probs(engine, variant, ids, ref.token_ids)
                if len(lp):
                    same += int((lp.argmax(-1) == torch.tensor(ref.token_ids)).sum())
                    kl += float((ref_log_probs.exp() * (ref_log_probs - lp)).sum())
                steps += len(ref.token_ids)
            done[name] = {"same": same, "steps": steps, "kl": kl}
            args.json.write_text(json.dumps(report, indent=1))
            print(f"{key} {name}: top-1 {same}/{steps}, KL {kl / max(1, steps):.4f} ({time.perf_counter() - t0:.0f}s)",
                  file=sys.stderr)  # fmt: skip
    return report


def section(report: dict) -> list[str]:
    """docs/storage.md's ablation table: per layout, top-1 pooled over the documents with its
    Wilson 95% interval and mean KL per answer token, in the order of LAYOUTS."""
    from rocketkv_cli.eval.stats import wilson

    results = report.get("results", {})
    if not results:
        return []
    groups = sorted({k.rsplit("/", 1)[0] for k in results})
    lines = ["## Ablation: where int4's error lives", "",
             "Generated by `python scripts/storage_ablation.py` (raw counts in `docs/bench/storage-ablation.json`):",
             "the float32 cache of each document (the storage report's documents and questions, default budget)",
             "rounded in each layout below, scored teacher-forced against the float32 cache's greedy answers",
             "(HSA at every step as in decode). `sim:` rows are quantizers written in the script to test an idea,",
             "not storage types.", ""]  # fmt: skip
    for group in groups:
        docs = [v for k, v in results.items() if k.rsplit("/", 1)[0] == group]
        preset, n = group.split("/")
        lines += [f"**{preset}, {n} tokens, {len(docs)} documents**", "",
                  "| layout | top-1 vs float32 (95% CI) | KL |", "| --- | ---: | ---: |"]  # fmt: skip
        for name, what in report.get("layouts", LAYOUTS).items():
            rows = [d[name] for d in docs if name in d]
            if len(rows) < len(docs):
                continue
            same, steps = sum(r["same"] for r in rows), sum(r["steps"] for r in rows)
            lo, hi = wilson(same, steps)
            kl = sum(r["kl"] for r in rows) / max(1, steps)
            lines.append(f"| {name} — {what} | {same / steps:.3f} ({lo:.3f}–{hi:.3f}, {steps} tokens) | {kl:.4f} |")
        lines.append("")
    return lines


def pooled(report: dict, name: str) -> tuple[int, int, float] | None:
    """(same, steps, mean KL) of a layout over every document of the report, or None."""
    rows = [d[name] for d in report.get("results", {}).values() if name in d]
    if not rows or len(rows) < len(report["results"]):
        return None
    same, steps = sum(r["same"] for r in rows), sum(r["steps"] for r in rows)
    return same, steps, sum(r["kl"] for r in rows) / max(1, steps)


def alloc_note(rows: dict) -> str:
    """What allocating key bits by query energy (the sim row, built as `int4+alloc`) did here."""
    sim, int4 = rows.get("sim: key bits by query energy"), rows.get("int4")
    if sim is None or int4 is None:
        return ""
    return (f" Allocating the key bits by query energy (`sim: key bits by query energy`: widths 2–6 and 8, "
            f"the Lagrangian solution without a fill of unspent bits, float32 ranges) gave KL {sim[2]:.4f} against "
            f"int4's {int4[2]:.4f} and top-1 {sim[0] / sim[1]:.3f} against {int4[0] / int4[1]:.3f}. The storage "
            "built from it, `int4+alloc` (widths 2–8, every bit spent, float16 ranges, +1 byte per channel and "
            "head), is measured in the tables above. What is left is the bits themselves: entropy coding of the "
            "codes, or KVTC-style decorrelation across channels (arXiv 2511.01815).")  # fmt: skip


def transform_note(report: dict, rows: dict, storage: dict | None = None) -> str:
    """What the two remaining ideas measured: PCA decorrelation (`sim: PCA, …`) and entropy coding
    of int4's codes (`code_entropy`), with the bytes a stored basis would cost. rows: `pooled` per
    layout; storage: the storage report's results (None: docs/bench/storage.json), for int4's
    file size at the ablation's length."""
    cal, own, int4 = (rows.get(n) for n in ("sim: PCA, calibrated basis", "sim: PCA, own basis", "int4"))
    ent, shape, bar = report.get("entropy", {}), report.get("shape"), rows.get("int4 full-attention layers only")
    if cal is None or own is None or int4 is None or bar is None or len(ent) < len(report.get("results", {})):
        return ""
    if not shape:
        return ""
    group = next(iter(report["results"])).rsplit("/", 1)[0]  # preset/length
    if storage is None:
        storage = json.loads((ROOT / "docs" / "bench" / "storage.json").read_text())["results"]
    files = [r["file_bytes"] for k, v in storage.items() if k.startswith(group + "/") for r in v["rows"]
             if r["kv_dtype"] == "int4"]  # fmt: skip
    if not files:
        return ""
    n = sum(e["codes"] for e in ent.values())
    hk, hv = (sum(e[s] * e["codes"] for e in ent.values()) / n for s in ("keys", "values"))
    saved = 1 - (hk + hv) / 8
    basis = shape["n_layers"] * shape["n_kv_heads"] * 2 * shape["head_dim"] ** 2 * 2
    return (f" Both were measured. **Decorrelation** (`sim: PCA, …`, the simulation of KVTC's transform coding): "
            f"with principal components calibrated once per model on one other text (the GPL), KL {cal[2]:.4f} "
            f"against int4's {int4[2]:.4f} (top-1 {cal[0] / cal[1]:.3f}): that basis did not carry over to these "
            f"documents (what a component left at 0 bits holds is lost; a broader calibration set is untried). "
            f"With each layer's components fitted to its own tokens (in-sample, so at best what a stored basis "
            f"could do with this allocation) KL {own[2]:.4f} (top-1 {own[0] / own[1]:.3f}), and that basis would "
            f"have to be stored: as a full float16 D×D matrix per "
            f"layer, KV head, keys and values: {basis:,} bytes for this model, "
            f"{basis / (sum(files) / len(files)):.1f}× int4's whole file at {group.split('/')[1]} tokens "
            f"({sum(files) // len(files):,} bytes). **Entropy coding** of "
            f"int4's codes (one symbol table per layer and channel, order 0) would need {hk:.2f} bits per key code "
            f"and {hv:.2f} per value code instead of 4: {saved:.0%} of the codes' bytes, about "
            f"{(8 - hk - hv) / 2:.2f} bits per number to spend on finer steps, which lowers the mean squared "
            f"rounding error about {2 ** ((8 - hk - hv)):.1f}× — short of the {int4[2] / bar[2]:.0f}× "
            f"(about {math.log(int4[2] / bar[2], 4):.1f} bits per number) between int4's KL and "
            f"{bar[2]:.4f}, that of `int4 full-attention layers only`, whose top-1 ({bar[0] / bar[1]:.3f}) "
            "reached the bar.")  # fmt: skip


def finding(report: dict, bar: float, storage: dict | None = None) -> list[str]:
    """The 'what would close the Gemma gap' note, its numbers taken from the ablation's rows
    (storage: the storage report's results, for int4's file size; None: docs/bench/storage.json)."""
    rows = {name: pooled(report, name) for name in LAYOUTS}
    need = ("int4", "int4 keys only", "int4 values only", "int4 full-attention layers only",
            "int4 sliding-window layers only")  # fmt: skip
    if any(rows.get(n) is None for n in need):
        return []
    kl = {n: rows[n][2] for n in need}  # type: ignore[index]
    top1 = {n: r[0] / r[1] for n, r in rows.items() if r is not None}
    int4_like = [n for n in top1 if n not in ("int8", "int4 full-attention layers only", "int4 keys only",
                                               "int4 values only", "int4 sliding-window layers only",
                                               "sim: PCA, own basis")]  # fmt: skip
    best = max(int4_like, key=lambda n: top1[n])
    finer = min((n for n in int4_like if n in rows and rows[n] is not None), key=lambda n: rows[n][2])  # type: ignore[index]
    full_only = "int4 full-attention layers only"
    return [
        f"- **What would close the Gemma gap** (the ablation above). int4's KL ({kl['int4']:.4f}) comes mostly "
        f"from the sliding-window layers ({kl['int4 sliding-window layers only']:.4f} with only them rounded, "
        f"{kl[full_only]:.4f} with only the full-attention layers, whose top-1 then stays at {top1[full_only]:.3f}) "
        f"and more from keys ({kl['int4 keys only']:.4f}) than values ({kl['int4 values only']:.4f}). The lowest "
        f"KL of the int4-like layouts is `{finer}`'s ({rows[finer][2]:.4f}); "  # type: ignore[index]
        + (f"none reaches top-1 {bar}: the best is" if top1[best] < bar else f"top-1 {bar} is reached by")
        + f" `{best}` at {top1[best]:.3f} (int8: {top1.get('int8', float('nan')):.3f}). The 15 sliding-window "
        "layers store the document's last 512 tokens whole and their keys need about int8's precision, so 1/20 "
        "at the bar needs close to int8's fidelity at int4's bytes there."
        + alloc_note(rows)  # type: ignore[arg-type]
        + transform_note(report, rows, storage),
    ]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="gemma-3-270m")
    ap.add_argument("--length", type=int, default=32000)
    ap.add_argument("--samples", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--scratch", type=Path, default=ROOT / "build" / "storage-ablation")
    ap.add_argument("--json", type=Path, default=ROOT / "docs" / "bench" / "storage-ablation.json")
    ap.add_argument("--from-json", action="store_true", help="only rewrite docs/storage.md from the JSONs")
    ap.add_argument(
        "--only",
        action="append",
        default=[],
        choices=list(LAYOUTS),
        metavar="LAYOUT",
        help="run only these layouts (repeatable)",
    )
    args = ap.parse_args()
    if not args.from_json:
        run(args)
    import storage_report

    out = ROOT / "docs" / "storage.md"
    out.write_text(storage_report.page(json.loads((ROOT / "docs" / "bench" / "storage.json").read_text())))
    print(f"wrote {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
