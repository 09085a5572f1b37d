"""The accuracy frontier (`rocketkv_cli/eval/frontier.py`, `scripts/frontier_report.py`): the grid,
a point equal to what the product does, and the report's smoke run with its resume."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import make_engine

from rocketkv_cli.core.config import PrefillConfig
from rocketkv_cli.engine.answer import answer, decode_config_for
from rocketkv_cli.engine.inputs import Document, tokenize
from rocketkv_cli.eval.frontier import (
    FrontierConfig,
    grid,
    reselect_working_set,
    run_sample,
    store_tokens,
    time_points,
)
from rocketkv_cli.eval.tasks import generate

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(
    ("spec", "n", "tokens"),
    [
        ("all", 4126, 4126),
        ("50%", 4126, 2063),
        ("25%", 4096, 1024),
        ("4096", 4126, 4096),
        ("8192", 4126, 4126),
        ("100%", 10, 10),
    ],
)
def test__store_tokens__all_share_or_count_never_above_the_document(spec, n, tokens):
    assert store_tokens(spec, n) == tokens


@pytest.mark.parametrize("spec", ["", "half", "0", "0%", "150%", "-5", "12.5%"])
def test__store_tokens__anything_else_is_refused(spec):
    with pytest.raises(ValueError, match="a store is 'all'"):
        store_tokens(spec, 4096)


def test__reselect_working_set__the_prompt_budget_of_t_by_hand():
    # S = 4096 + 128 = 4224; c = S/t; r = 0.2 + 0.06·log2(c); prompt budget = floor(S / c^r) − 128
    assert reselect_working_set(4096, 128, 512) == 1755  # c 8.25, r 0.3827, c^r 2.2425 → 1883 − 128
    assert reselect_working_set(4096, 128, 1024) == 2545  # c 4.125, r 0.3227, c^r 1.5798 → 2673 − 128


def test__grid__smollm2_shape_equal_stores_once_and_modes_only_where_they_prune():
    cfg = FrontierConfig(context_tokens=4096, tasks=("niah_noise",), samples=1, kv_dtype="int4")
    labels = [p.label for p in grid(cfg)]
    assert labels == [
        "everything = 4096 · exact", "everything = 4096 · hsa@256", "everything = 4096 · hsa@512",
        "everything = 4096 · hsa@1024", "everything = 4096 · reselect@512", "everything = 4096 · reselect@1024",
        "50% = 2048 · exact", "50% = 2048 · hsa@256", "50% = 2048 · hsa@512", "50% = 2048 · hsa@1024",
        "50% = 2048 · reselect@512",  # 1024's working set (2545 tokens) is above the store
        "25% = 1024 · exact", "25% = 1024 · hsa@256", "25% = 1024 · hsa@512",
    ]  # fmt: skip


@pytest.mark.parametrize("kw", [dict(tasks=()), dict(tasks=("nope",)), dict(stores=("50%",)),
                                dict(stores=("all", "all")), dict(stores=("all", "half")), dict(samples=0),
                                dict(hsa_budgets=(1,)), dict(kv_dtype="int3"),
                                dict(stage1=(("observation", "nope"),))])  # fmt: skip
def test__frontier_config__bad_values_raise(kw):
    base = dict(context_tokens=4096, tasks=("niah_noise",), samples=1, kv_dtype="int8")
    with pytest.raises(ValueError):
        FrontierConfig(**(base | kw))


def test__frontier_point__reselect_equals_the_product_answering_from_a_store_budget_file(tmp_path):
    """The frontier's "store S · reselect@t" is what `ingest --budget t --store-budget B` then
    `ask` does (B chosen so that the file stores S): the same answers, token for token."""
    engine = make_engine("llama")
    count = lambda text: len(tokenize(engine.tokenizer, text, False))  # noqa: E731
    sample = generate("multiquery", 0, 0, 600, count, None)
    doc = Document(sample.document, "0" * 64, "doc")
    n, t = len(engine.document_ids(doc)), 128
    product = engine.ingest(doc, PrefillConfig(token_budget=t, store_budget=256, window_size=8, n_first_tokens=4))
    stored = product.layers[0].n_kept_tokens
    assert reselect_working_set(n, 128, t) < stored < n  # the file stores more than one question's working set
    # as `ask` decodes on a device whose HSA crossover is 0 (CUDA): the re-selected working set exactly
    decode = decode_config_for(product, True, exact_working_set=1, min_hsa_tokens=0)
    assert decode.min_hsa_tokens == product.info.budgets.prompt_budget
    expected = [a.text for a in answer(engine, product, [q.text for q in sample.questions], sample.max_new_tokens,
                                       decode)]  # fmt: skip
    cfg = FrontierConfig(context_tokens=n, tasks=("multiquery",), samples=1, kv_dtype="int8",
                         stores=("all", str(stored)), hsa_budgets=(), reselect_budgets=(t,), window_size=8,
                         stage1=(("n_first_tokens", 4),))  # fmt: skip
    row = run_sample(engine, cfg, sample, tmp_path)
    got = [r["answer"] for r in row["records"] if r["label"] == f"{stored} · reselect@{t}"]
    assert got == expected
    assert row["stores"][str(stored)]["tokens"] == stored and row["stores"]["everything"]["tokens"] == n


def test__frontier_point__everything_reselect_equals_a_store_budget_all_file(tmp_path):
    """ "everything · reselect@t" is `ingest --budget t --store-budget all` then `ask`: the file
    keeps every token and the answers are the frontier point's, token for token."""
    engine = make_engine("llama")
    count = lambda text: len(tokenize(engine.tokenizer, text, False))  # noqa: E731
    sample = generate("multikey", 1, 0, 500, count, None)
    doc = Document(sample.document, "0" * 64, "doc")
    n, t = len(engine.document_ids(doc)), 128
    product = engine.ingest(doc, PrefillConfig(token_budget=t, store_budget="all", window_size=8, n_first_tokens=4))
    assert {layer.n_kept_tokens for layer in product.layers} == {n} and product.info.budgets.prompt_budget < n
    decode = decode_config_for(product, True, exact_working_set=1, min_hsa_tokens=0)  # as `ask` on CUDA
    expected = [a.text for a in answer(engine, product, [q.text for q in sample.questions], sample.max_new_tokens,
                                       decode)]  # fmt: skip
    cfg = FrontierConfig(context_tokens=n, tasks=("multikey",), samples=1, kv_dtype="int8", stores=("all",),
                         hsa_budgets=(), reselect_budgets=(t,), window_size=8,
                         stage1=(("n_first_tokens", 4),))  # fmt: skip
    row = run_sample(engine, cfg, sample, tmp_path)
    assert [r["answer"] for r in row["records"] if r["label"] == f"everything · reselect@{t}"] == expected


def test__frontier_report__quick_run_writes_the_page_and_resumes(tiny_model_dir, tmp_path):
    """`scripts/frontier_report.py --quick` on a tiny model: one JSON line per sample after a
    header, the page marked as a smoke run; a rerun resumes (nothing run again); a file written
    with another configuration is refused in one line."""
    env = {**os.environ, "ROCKETKV_HOME": str(tmp_path / "home"), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    hay = tmp_path / "hay.txt"
    hay.write_text("The river ran north past the green stone and the seven lanterns.\n" * 200)
    cmd = [sys.executable, str(ROOT / "scripts" / "frontier_report.py"), "--quick", "--model", str(tiny_model_dir),
           "--context-tokens", "300", "--haystack", str(hay), "--out-dir", str(tmp_path / "out")]  # fmt: skip
    r = subprocess.run([*cmd, "--time"], capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    timed = json.loads((tmp_path / "out" / "bench" / f"frontier-{tiny_model_dir.name}-timing.json").read_text())
    assert set(timed["decode_ms"]) >= {"everything · exact"} and all(v > 0 for v in timed["decode_ms"].values())
    lines = (tmp_path / "out" / "bench" / f"frontier-{tiny_model_dir.name}.jsonl").read_text().splitlines()
    head, rows = json.loads(lines[0]), [json.loads(x) for x in lines[1:]]
    assert head["format"] == "rocketkv.frontier" and len(rows) == 5
    tasks = {row["timing"]["task"] for row in rows}
    assert tasks == {"niah_noise", "niah_text", "multikey", "multivalue", "multiquery"}
    full = [rec for row in rows for rec in row["records"] if rec["label"] == "everything · exact"]
    assert full and all(rec["top1_agreement"] is None for rec in full)
    assert all(rec["top1_agreement"] is not None for row in rows for rec in row["records"] if rec not in full)
    page = (tmp_path / "out" / "frontier.md").read_text()
    assert "QUICK SMOKE RUN" in page and "| everything | " in page and "Default rule" in page
    assert "timed side by side in one process" in page
    again = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert again.returncode == 0 and " in " not in again.stderr.replace("wall time", ""), again.stderr[-2000:]
    assert len((tmp_path / "out" / "bench" / f"frontier-{tiny_model_dir.name}.jsonl").read_text().splitlines()) == 6
    # --focus: one more line per sample already run, a row and a per-task table on the page; a rerun resumes
    focus_path = tmp_path / "out" / "bench" / f"frontier-{tiny_model_dir.name}-focus.jsonl"
    for _ in range(2):
        f = subprocess.run([*cmd, "--focus"], capture_output=True, text=True, env=env, timeout=600)
        assert f.returncode == 0, f.stderr[-3000:]
    assert f.stderr.count("focus ") == 0, f.stderr[-2000:]  # the second run had nothing left to do
    focused = [json.loads(x) for x in focus_path.read_text().splitlines()[1:]]
    assert sorted((x["timing"]["task"], x["timing"]["sample"]) for x in focused) == sorted(
        (row["timing"]["task"], row["timing"]["sample"]) for row in rows
    )
    for x, row in zip(
        sorted(focused, key=lambda x: x["timing"]["task"]), sorted(rows, key=lambda r: r["timing"]["task"])
    ):
        full_answers = [r for r in row["records"] if r["label"] == "everything · exact"]
        assert [r["question_index"] for r in x["records"]] == [r["question_index"] for r in full_answers]
        # the hay shares "the" with every question, so each question re-read passages of its own
        assert all(r["passages"] and not r["fallback"] and r["mode"] == "focus" for r in x["records"])
    page = (tmp_path / "out" / "frontier.md").read_text()
    assert "| everything | " in page and "focus, 4 passages" in page and "| all tasks |" in page, page[-3000:]
    # each focus answer is what `ask --focus 4` (`RocketKV.ask_focused`) answers over a file of the document
    from rocketkv_cli.api.rocketkv import RocketKV
    from rocketkv_cli.engine.inputs import tokenize
    from rocketkv_cli.eval.tasks import generate

    rk = RocketKV.load(str(tiny_model_dir))
    count = lambda text: len(tokenize(rk.engine.tokenizer, text, False))  # noqa: E731
    (x,) = [x for x in focused if x["timing"]["task"] == "multiquery"]
    sample = generate("multiquery", 0, head["config"]["seed"], 300, count, hay.read_text())
    cache = rk.ingest(text=sample.document).cache
    for q, rec in zip(sample.questions, x["records"]):
        got = rk.ask_focused(cache, q.text, passages=4, max_new_tokens=sample.max_new_tokens)
        assert [[p.first_line, p.last_line] for p in got.passages] == rec["passages"]
        assert got.answer.text == rec["answer"]
    # --stage1: another method screened (stores everything/50%/25%, exact and re-selection), its own file,
    # resumable, and a section on the page beside the preset's own method on the same samples
    for _ in range(2):
        sc = subprocess.run([*cmd, "--stage1", "observation=combined"], capture_output=True, text=True, env=env,
                            timeout=600)  # fmt: skip
        assert sc.returncode == 0, sc.stderr[-3000:]
    screened = [json.loads(x) for x in (tmp_path / "out" / "bench" / f"frontier-{tiny_model_dir.name}-stage1-"
                                        "observation-combined.jsonl").read_text().splitlines()]  # fmt: skip
    assert screened[0]["config"]["stage1"]["observation"] == "combined" and len(screened) == 6  # no rerun twice
    assert screened[0]["config"]["stores"] == ["all", "50%", "25%"] and screened[0]["config"]["hsa_budgets"] == []
    # t=64's working set of a 300-token document (177 tokens) is larger than either pruned store: exact only there
    assert {r["label"] for r in screened[1]["records"]} == {"everything · exact", "everything · reselect@64",
                                                            "50% · exact", "25% · exact"}  # fmt: skip
    page = (tmp_path / "out" / "frontier.md").read_text()
    assert "### Other stage-1 methods" in page and "| observation combined | 50% |" in page, page[-3000:]
    assert "| observation tail | 50% |" in page, page[-3000:]  # the preset's own method on the same samples
    path = tmp_path / "out" / "bench" / f"frontier-{tiny_model_dir.name}.jsonl"
    path.write_text(json.dumps(head | {"digest": "other"}) + "\n" + "\n".join(lines[1:]) + "\n")
    refused = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert refused.returncode == 1 and any(x.startswith("error: ") for x in refused.stderr.splitlines()), refused.stderr
    assert "Traceback" not in refused.stderr


def _script(name: str):
    """scripts/<name>.py imported as a module (the scripts are not a package)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test__prose_questions__every_expected_string_is_in_its_document():
    """The hand-written expected strings can be right: each question has at least one that the
    document it is asked about contains (a typo in the set would make a question unanswerable)."""
    mod = _script("prose_report")
    spec = json.loads((ROOT / "tests" / "data" / "prose_questions.json").read_text())
    data = ROOT.parent / "shared" / "data"
    if not (data / "kjv.txt").exists():
        pytest.skip("the shared documents are not on this machine")
    texts = {doc: mod.document_text(d, data).lower() for doc, d in spec["documents"].items()}
    assert len(spec["questions"]) >= 20 and set(texts) == {"gpl", "ruth-jonah"}
    for q in spec["questions"]:
        assert any(e.lower() in texts[q["doc"]] for e in q["expected"]), q
    assert texts["ruth-jonah"].splitlines()[0].startswith("ruth1:1 ") and "genesis" not in texts["ruth-jonah"]


def test__prose_report__quick_run_on_a_tiny_model_writes_the_page_and_resumes(tiny_model_dir, tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    (data / "gpl-3.txt").write_text("The GNU General Public License, version 3, 29 June 2007.\n" * 10)
    (data / "kjv.txt").write_text("Genesis1:1 In the beginning.\nRuth1:2 The man was Elimelech.\n"
                                  "Jonah1:1 Jonah the son of Amittai.\n")  # fmt: skip
    env = {**os.environ, "ROCKETKV_HOME": str(tmp_path / "home"), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, str(ROOT / "scripts" / "prose_report.py"), "--quick", "--model", str(tiny_model_dir),
           "--data", str(data), "--out-dir", str(tmp_path / "out")]  # fmt: skip
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    rep = json.loads((tmp_path / "out" / "bench" / f"prose-{tiny_model_dir.name}.json").read_text())
    setups = ("full", "default", "pruned-512", "focus", "focus-start", "focus-attention", "focus-mixed")
    assert set(rep["results"]) == {f"{s}/{d}" for s in setups for d in ("gpl", "ruth-jonah")}
    assert all(len(v["answers"]) == 2 for v in rep["results"].values())
    page = (tmp_path / "out" / "prose-questions.md").read_text()
    assert "QUICK SMOKE RUN" in page and "| full |" in page and "| default |" in page and "| focus |" in page
    again = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert again.returncode == 0 and "right" not in again.stderr, again.stderr[-2000:]  # all kept: nothing asked
    bad = subprocess.run([*cmd, "--setups", "nope"], capture_output=True, text=True, env=env, timeout=600)
    assert bad.returncode == 2 and "error: unknown setup 'nope'" in bad.stderr, bad.stderr  # a usage error


def test__prose_report__right_when_any_expected_string_is_in_the_answer():
    mod = _script("prose_report")
    assert mod.is_right("It was Elimelech, her husband.", ["elimelech"])
    assert mod.is_right("three years", ["three", "3 years"]) and not mod.is_right("ten years", ["three", "3 years"])


def test__time_points__every_named_point_timed_and_an_unknown_one_refused(tmp_path):
    engine = make_engine("llama")
    count = lambda text: len(tokenize(engine.tokenizer, text, False))  # noqa: E731
    sample = generate("niah_noise", 0, 0, 300, count, None)
    cfg = FrontierConfig(context_tokens=300, tasks=("niah_noise",), samples=1, kv_dtype="int8", stores=("all", "50%"),
                         hsa_budgets=(64,), reselect_budgets=(), window_size=8)  # fmt: skip
    labels = ["everything · exact", "50% · hsa@64"]
    ms = time_points(engine, cfg, sample, labels, tmp_path, rounds=2)
    assert set(ms) == set(labels) and all(v > 0 for v in ms.values())
    with pytest.raises(ValueError, match="not points of the grid"):
        time_points(engine, cfg, sample, ["everything · hsa@9999"], tmp_path)


def test__frontier_summary__solved_tasks_share_of_full_the_bar_and_the_tie_break_by_hand():
    """The report's arithmetic on made-up results: only the task full attention solves counts for
    the score; a point passes with ≥ 98% of full's score and top-1 ≥ 0.98; of the passing points
    the smallest file wins, and between equal files the faster step of the side-by-side timing."""
    mod = _script("frontier_report")

    def rec(label, task, score, top1, sample=0):
        store, mode = label.split(" · ")
        return {"label": label, "store_label": store, "store": 10 if store == "everything" else 5,
                "mode": mode.split("@")[0], "budget": int(mode.split("@")[1]) if "@" in mode else None, "task": task,
                "score": score, "top1_agreement": top1, "kl": None if top1 is None else 0.1,
                "stored_tokens": 10 if store == "everything" else 5, "n_context_tokens": 10, "sample": sample,
                "question_index": 0}  # fmt: skip

    def row(i, a_scores):
        full, resel, half, hsa = (
            "everything · exact",
            "everything · reselect@512",
            "50% · exact",
            "everything · hsa@256",
        )
        a = 1.0 - i / 2  # full attention's score on task A: 1.0 on sample 0, 0.5 on sample 1
        records = [rec(full, "A", a, None, i), rec(full, "B", 0.0, None, i), rec(resel, "A", a, 1.0, i),
                   rec(resel, "B", 0.0, 1.0, i), rec(half, "A", a_scores, 0.99, i), rec(half, "B", 1.0, 0.99, i),
                   rec(hsa, "A", a, 0.9, i), rec(hsa, "B", 0.0, 0.9, i)]  # fmt: skip
        stores = {"everything": {"tokens": 10, "file_bytes": 1000}, "50%": {"tokens": 5, "file_bytes": 500}}
        return {"records": records, "stores": stores, "timing": {"n_context_tokens": 10, "total_s": 1.0,
                                                                  "task": "AB", "sample": i}}  # fmt: skip

    head = {
        "layers": [None, None],
        "n_kv_heads": 1,
        "head_dim": 4,
        "digest": "d",
        "date": "today",
        "machine": {"rocketkv": "x", "torch": "y", "threads": 1, "cpu": "z"},
        "config": {"context_tokens": 10, "kv_dtype": "int8", "stage1": {}, "tasks": ["A", "B"], "samples": 2},
    }
    lines = [head, row(0, 1.0), row(1, 0.0)]
    # focus run on sample 1 only: full scored 0.5 on A there, so focus's 0.5 is all of full's
    focused = [rec("everything · focus@4", "A", 0.5, None, 1) | {"fallback": False},
               rec("everything · focus@4", "B", 1.0, None, 1) | {"fallback": True}]  # fmt: skip
    focus = [{"digest": "d:focus@4"}, {"timing": {"task": "AB", "sample": 1, "total_s": 60.0}, "records": focused}]
    s = mod.summarize(lines, "tiny", {"decode_ms": {"everything · exact": 9.0, "everything · reselect@512": 4.0}},
                      [focus])  # fmt: skip
    by = {p["label"]: p for p in s["points"]}
    assert s["solved"] == ["A"] and s["full_score"] == 0.75  # B: full scores 0, it says nothing about loss
    assert by["50% · exact"]["share_of_full"] == 0.5 / 0.75 and not by["50% · exact"]["passes"]  # B's 1.0 not counted
    assert by["everything · focus@4"]["share_of_full"] == 1.0 and not by["everything · focus@4"]["passes"]  # no top-1
    (f,) = s["focus"]
    assert (f["samples"], f["fallbacks"], f["by_task"], f["all"]) == (1, 1, {"A": (0.5, 0.5), "B": (0.0, 1.0)},
                                                                      (0.25, 0.75))  # fmt: skip
    assert "| B | 0 | 100 |" in mod.render({"tiny": mod.summarize(lines, "tiny", None, [focus])}, quick=True)
    assert by["everything · hsa@256"]["share_of_full"] == 1.0 and not by["everything · hsa@256"]["passes"]  # top-1
    assert by["everything · reselect@512"]["passes"] and by["everything · exact"]["passes"]
    assert by["everything · exact"]["bytes_per_token"] == 100 and by["50% · exact"]["bytes_per_token"] == 50
    assert by["everything · exact"]["vs_bf16"] == 2 * 2 * 2 * 1 * 4 / 100  # K and V, 2 layers, 1 head, dim 4, bf16
    assert s["chosen"]["label"] == "everything · reselect@512"  # same file as full, the faster step
    slow = mod.summarize(lines, "tiny", {"decode_ms": {"everything · exact": 3.0, "everything · reselect@512": 4.0}})
    assert slow["chosen"]["label"] == "everything · exact"
    assert mod.product_settings(s["chosen"]) == {"store_budget": "all", "token_budget": 512}
    assert mod.product_settings(by["50% · exact"]) is None and mod.product_settings(by["everything · hsa@256"]) is None
    # a screened stage-1 method (`--stage1`): sample 1 only, two points; the preset's own rows are cut to the same
    tried = {"records": [rec("everything · exact", "A", 0.5, None, 1), rec("50% · exact", "A", 0.5, 0.99, 1)],
             "stores": {"everything": {"tokens": 10, "file_bytes": 1000}, "50%": {"tokens": 5, "file_bytes": 500}},
             "timing": {"n_context_tokens": 10, "total_s": 1.0, "task": "AB", "sample": 1}}  # fmt: skip
    own, other = mod.screen(lines, [head, tried], "tiny")
    assert {p["label"] for p in own["points"]} == {"everything · exact", "50% · exact"} and own["samples"] == 1
    assert [p["share_of_full"] for p in own["points"]] == [1.0, 0.0]  # its 50% row scored 0 of full's 0.5 there
    assert [p["share_of_full"] for p in other["points"]] == [1.0, 1.0]
    rendered = "\n".join(mod._render_screens([({}, own, other)], {}))
    assert "| observation tail | 50% | 5 | exact | 0 [0–0] | 0 |" in rendered, rendered
    with pytest.raises(ValueError, match="shares no sample"):
        mod.screen(lines, [head, tried | {"timing": tried["timing"] | {"sample": 7}}], "tiny")


@pytest.mark.parametrize("preset", ["smollm2-135m", "gemma-3-270m"])
def test__preset_defaults__are_the_point_the_committed_frontier_chooses(preset):
    """Defaults follow the measured frontier: the default rule applied to the committed results
    (docs/bench/frontier-<preset>.jsonl, with its side-by-side timing) picks a point, and `ingest`'s
    defaults for the preset are exactly that point's settings."""
    from rocketkv_cli.core.config import with_preset_defaults
    from rocketkv_cli.eval.reports import read_json, read_jsonl

    mod = _script("frontier_report")
    bench = ROOT / "docs" / "bench"
    lines = read_jsonl(bench / f"frontier-{preset}.jsonl")
    timed = bench / f"frontier-{preset}-timing.json"
    summary = mod.summarize(lines, preset, read_json(timed) if timed.exists() else None)
    settings = mod.product_settings(summary["chosen"])
    assert settings is not None, summary["chosen"]
    cfg = with_preset_defaults(PrefillConfig(), preset, [])
    assert {k: getattr(cfg, k) for k in settings} == settings, (summary["chosen"]["label"], cfg)
