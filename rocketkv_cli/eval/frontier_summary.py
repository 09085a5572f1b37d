"""The arithmetic of docs/frontier.md (`scripts/frontier_report.py`): from the report's JSON lines,
each point's score on the tasks full attention solves and its share of full's, top-1 agreement,
KL, file bytes per token, decode time, and the point the default rule chooses. Pure Python over
the committed results (no model), so the page and the presets' defaults can be checked in tests.
"""

from __future__ import annotations

from collections import defaultdict

from ..core.config import FOCUS_RANKINGS
from .stats import bootstrap_mean

SCORE_BAR, TOP1_BAR = 0.98, 0.98  # the default rule
SOLVED = 0.5  # a task "full attention solves": its mean score at least this
# llama.cpp's state file (the full f16 KV cache), bytes per document token, from the files docs/performance.md
# measured ("Side by side with llama.cpp"): SmolLM2 179.8 MB at 7,800 tokens, Gemma 3 270M 151.2 MB at 8,192
LLAMACPP_BYTES_PER_TOKEN = {"smollm2-135m": 179.8e6 / 7800, "gemma-3-270m": 151.2e6 / 8192}


def product_settings(point: dict | None) -> dict | None:
    """The `ingest` settings (PrefillConfig fields) that answer exactly as a point of the grid does,
    where one exists: everything stored and re-selected per question (`--store-budget all --budget
    t`), or everything stored and attended exactly (`--store-budget all` with a budget above any
    document). None for the others (HSA over a stored set, or a pruned store, which `ingest` sizes
    by a budget rather than a count)."""
    if point is None or not point["store_label"].startswith("everything"):
        return None
    if point["mode"] == "reselect":
        return {"store_budget": "all", "token_budget": point["budget"]}
    if point["mode"] == "exact":
        return {"store_budget": "all", "token_budget": 1 << 30}
    return None


def summarize(lines: list[dict], model: str, timing: dict | None = None,
              focus: list[list[dict]] | None = None) -> dict:  # fmt: skip
    """Per point: score on the tasks full solves (and its share of full's), top-1 agreement, KL,
    stored tokens, file bytes per token, decode ms/token; and the point the default rule picks.
    focus: `run_focus`'s files (one per ranking); each joins as one more point, scored on its own
    samples (of those in `lines`), its share of full's and its per-task comparison taken against
    full attention's answers on those same samples."""
    head, rows = lines[0], lines[1:]
    recs = [r for row in rows for r in row["records"]]
    ran = {(row["timing"]["task"], row["timing"]["sample"]) for row in rows}
    kept = [
        (one[0], [f for f in one[1:] if (f["timing"]["task"], f["timing"]["sample"]) in ran]) for one in focus or []
    ]
    focus_heads = [h for h, one in kept if one]
    focus_sets = [one for _, one in kept if one]
    for one in focus_sets:
        recs += [r for f in one for r in f["records"]]
    full = [r for r in recs if r["label"] == recs[0]["label"]]  # everything, exact: each sample's first
    by_task: dict[str, list[float]] = defaultdict(list)
    for r in full:
        by_task[r["task"]].append(r["score"])
    solved = sorted(t for t, v in by_task.items() if sum(v) / len(v) >= SOLVED)
    full_score = _mean([r["score"] for r in full if r["task"] in solved])
    bytes_per_tok: dict[str, list[float]] = defaultdict(list)
    for row in rows:
        n = row["timing"]["n_context_tokens"]
        for label, s in row["stores"].items():
            bytes_per_tok[label].append(s["file_bytes"] / n)
    decode_ms = {k: v for row in rows[:1] for s in row["stores"].values() for k, v in s.get("decode_ms", {}).items()}
    if timing is not None:  # the side-by-side timing replaces the first sample's
        decode_ms = {label: timing["decode_ms"].get(label) for label in decode_ms} | timing["decode_ms"]
    points: dict[str, list[dict]] = defaultdict(list)
    for r in recs:
        points[r["label"]].append(r)
    bf16 = 2 * 2 * len(head["layers"]) * head["n_kv_heads"] * head["head_dim"]  # K and V, bytes per token
    out = []
    full_by_key = {(r["task"], r["sample"], r["question_index"]): r["score"] for r in full}
    for label, rs in points.items():
        first = rs[0]
        on_solved = [r["score"] for r in rs if r["task"] in solved]
        # full's score on the same answers (all of them but for a focus point run on fewer samples)
        base = _mean([full_by_key[(r["task"], r["sample"], r["question_index"])] for r in rs if r["task"] in solved])
        top1 = [r["top1_agreement"] for r in rs if r["top1_agreement"] is not None]
        kls = [r["kl"] for r in rs if r["kl"] is not None]
        b = _mean(bytes_per_tok[first["store_label"]])
        is_full = label == full[0]["label"]
        out.append({
            "label": label, "store": first["store"], "stored_tokens": _mean([r["stored_tokens"] for r in rs]),
            "store_label": first["store_label"], "mode": first["mode"],
            "budget": first["budget"], "n": len(rs), "score": _mean(on_solved),
            "score_ci": bootstrap_mean(on_solved) if on_solved else None,
            "share_of_full": sum(on_solved) / len(on_solved) / base if base and on_solved else None,
            "top1": 1.0 if is_full else _mean(top1), "top1_ci": None if is_full or not top1 else bootstrap_mean(top1),
            "kl": 0.0 if is_full else _mean(kls), "bytes_per_token": b, "vs_bf16": bf16 / b if b else None,
            "vs_llamacpp": LLAMACPP_BYTES_PER_TOKEN[model] / b if b and model in LLAMACPP_BYTES_PER_TOKEN else None,
            "decode_ms": decode_ms.get(label),
            "all_tasks_score": _mean([r["score"] for r in rs]),
            "ranking": first.get("ranking", "bm25") if first["mode"] == "focus" else None,
        })  # fmt: skip
    out.sort(key=lambda p: (-p["store"], ["exact", "hsa", "reselect", "focus"].index(p["mode"]), p["budget"] or 0,
                            FOCUS_RANKINGS.index(p["ranking"]) if p["ranking"] else 0))  # fmt: skip
    for p in out:
        p["passes"] = (p["share_of_full"] or 0) >= SCORE_BAR and (p["top1"] or 0) >= TOP1_BAR
    passing = [p for p in out if p["passes"] and product_settings(p) is not None]  # only what `ingest` can make
    smallest = min((p["bytes_per_token"] for p in passing), default=None)
    cheapest = [p for p in passing if p["bytes_per_token"] == smallest]  # the smallest file; then the fastest step
    chosen = (
        min(cheapest, key=lambda p: p["decode_ms"] if p["decode_ms"] is not None else float("inf"))
        if cheapest
        else None
    )
    n_samples = len(rows)
    elapsed = sum(row["timing"]["total_s"] for row in rows)
    focused: list[dict] = []
    for one in focus_sets:  # per ranking: its score per task beside full's, on the same answers
        frs = [r for f in one for r in f["records"]]
        same = [full_by_key[(r["task"], r["sample"], r["question_index"])] for r in frs]
        focused.append({
            "label": frs[0]["label"], "samples": len(one), "seconds": sum(f["timing"]["total_s"] for f in one),
            "date": focus_heads[len(focused)].get("date"), "machine": focus_heads[len(focused)].get("machine") or {},
            "fallbacks": sum(r["fallback"] for r in frs),
            "by_task": {t: (_mean([x for x, r in zip(same, frs) if r["task"] == t]),
                            _mean([r["score"] for r in frs if r["task"] == t])) for t in sorted(by_task)},
            "all": (_mean(same), _mean([r["score"] for r in frs])),
        })  # fmt: skip
    return {
        "points": out,
        "solved": solved,
        "full_score": full_score,
        "chosen": chosen,
        "samples": n_samples,
        "elapsed_s": elapsed,
        "head": head,
        "tasks": sorted(by_task),
        "timed": timing,
        "focus": focused,
    }


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def screen(main: list[dict], screened: list[dict], model: str) -> tuple[dict, dict]:
    """A stage-1 method screened against the preset's own (`frontier.screen_config`): (the preset's
    points from `main`, cut to the screen's samples and to its (store, mode, budget) points, and
    the screen's own), each as `summarize` gives them, so both are scored on the same documents
    and questions. Raises ValueError when the screen shares no sample with `main`."""
    runs = {(row["timing"]["task"], row["timing"]["sample"]) for row in screened[1:]}
    points = {(r["store"], r["mode"], r["budget"]) for row in screened[1:] for r in row["records"]}
    rows = [dict(row, records=[r for r in row["records"] if (r["store"], r["mode"], r["budget"]) in points])
            for row in main[1:] if (row["timing"]["task"], row["timing"]["sample"]) in runs]  # fmt: skip
    if not rows:
        raise ValueError("the screen shares no sample with the preset's frontier results")
    return summarize(main[:1] + rows, model), summarize(screened, model)
