"""`rocketkv eval`: task generators, scoring, the sink+recent selection, one-prefill variants, the CLI."""

import dataclasses
import json
import os
import re
import subprocess
from collections import Counter

import pytest
import torch
from conftest import byte_tokenizer, make_engine, same_layer, text_of_bytes

from rocketkv_cli.core.config import PrefillConfig
from rocketkv_cli.engine.answer import answer, decode_config_for
from rocketkv_cli.engine.inputs import Document
from rocketkv_cli.eval.plan import FULL_TOKEN_BUDGET, EvalConfig, plan, stage2_only_budgets
from rocketkv_cli.eval.runner import compress_variants, match_fraction, run_eval, token_agreement
from rocketkv_cli.eval.tasks import DEPTH_RANGE, TASKS, generate
from rocketkv_cli.methods.sink_recent import sink_recent_select
from rocketkv_cli.store.format import load_cache, save_cache

HAYSTACK = (
    "In the beginning the river ran north. The stone was green; the cloud was light: all was paper.\n"
    "Seven metal lanterns hung there. Who lit them? Nobody knows!\n"
) * 20
N_TOKENS = 2000


@pytest.fixture(scope="module")
def tok():
    return byte_tokenizer()


def count(tok):
    return lambda text: len(tok(text, add_special_tokens=False)["input_ids"])


@pytest.mark.parametrize("task", TASKS)
def test__generate__deterministic_per_seed(tok, task):
    a = generate(task, 3, 7, N_TOKENS, count(tok), HAYSTACK)
    b = generate(task, 3, 7, N_TOKENS, count(tok), HAYSTACK)
    assert a == b
    assert generate(task, 3, 8, N_TOKENS, count(tok), HAYSTACK).document != a.document
    assert generate(task, 4, 7, N_TOKENS, count(tok), HAYSTACK).document != a.document


@pytest.mark.parametrize("task", [t for t in TASKS if t != "fwe"])
@pytest.mark.parametrize("index", [0, 1, 2])
def test__generate__expected_values_sit_at_the_stated_depth(tok, task, index):
    s = generate(task, index, 0, N_TOKENS, count(tok), HAYSTACK)
    enc = tok(s.document, add_special_tokens=False, return_offsets_mapping=True)
    n = len(enc["input_ids"])
    assert abs(n - N_TOKENS) <= 0.05 * N_TOKENS
    starts = [start for start, _ in enc["offset_mapping"]]
    for question in s.questions:
        assert question.depths
        for value in question.expected:
            # the needle that holds the value (vt: the one assigning that variable)
            holds = (lambda t: t.startswith(f"VAR {value} =")) if task == "vt" else (lambda t: value in t)
            holders = [nd for nd in s.needles if holds(nd.text)]
            assert len(holders) == 1, (value, s.needles)
            needle = holders[0]
            assert needle.depth in question.depths
            assert s.document[needle.char_offset : needle.char_offset + len(needle.text)] == needle.text
            token_at = next(i for i, st in enumerate(starts) if st >= needle.char_offset)  # first token of the needle
            assert abs(token_at / n - needle.depth) <= 0.02, (token_at / n, needle.depth)
            assert DEPTH_RANGE[0] <= needle.depth <= DEPTH_RANGE[1]
            if task != "vt":
                assert s.document.count(value) == 1


def test__generate__multikey_distractors_have_other_keys_and_values(tok):
    s = generate("multikey", 0, 0, N_TOKENS, count(tok))
    (question,) = s.questions
    assert len(s.needles) == 4
    others = [nd for nd in s.needles if question.expected[0] not in nd.text]
    assert len(others) == 3 and all(question.text.split(" for ")[1].split()[0] not in nd.text for nd in others)


def test__generate__multiquery_asks_one_question_per_needle(tok):
    s = generate("multiquery", 0, 0, N_TOKENS, count(tok))
    assert len(s.questions) == len(s.needles) == 4
    assert len({q.text for q in s.questions}) == 4


def test__generate__vt_chain_leads_back_to_the_value(tok):
    s = generate("vt", 0, 0, N_TOKENS, count(tok))
    (question,) = s.questions
    value = question.text.split("value ")[1].split()[0]
    first, *rest = question.expected
    assert f"VAR {first} = {value}." in s.document
    for a, b in zip(question.expected, rest):
        assert f"VAR {b} = VAR {a}." in s.document


def test__generate__fwe_answer_is_the_three_most_frequent_words(tok):
    s = generate("fwe", 0, 0, N_TOKENS, count(tok))
    counts = Counter(s.document.split()).most_common(4)
    assert set(s.questions[0].expected) == {w for w, _ in counts[:3]}
    assert counts[2][1] > counts[3][1]


def test__generate__bad_input_raises(tok):
    with pytest.raises(ValueError, match="haystack"):
        generate("niah_text", 0, 0, N_TOKENS, count(tok))
    with pytest.raises(ValueError, match="unknown task"):
        generate("nope", 0, 0, N_TOKENS, count(tok))
    with pytest.raises(ValueError, match="at least 64"):
        generate("vt", 0, 0, 10, count(tok))


@pytest.mark.parametrize(
    "answer_text, expected, score",
    [
        ("The number is 1234567.", ("1234567",), 1.0),
        ("the word is ALPHA", ("alpha",), 1.0),
        ("1234567 and 7654321", ("1234567", "7654321", "1111111", "2222222"), 0.5),
        ("123456", ("1234567",), 0.0),
        ("", ("x",), 0.0),
    ],
)
def test__match_fraction__case_insensitive_share_of_expected_values(answer_text, expected, score):
    assert match_fraction(answer_text, expected) == score


def test__match_fraction__nothing_expected_raises():
    with pytest.raises(ValueError):
        match_fraction("x", ())


@pytest.mark.parametrize(
    "ref, out, agreement",
    [((1, 2, 3), (1, 2, 3), 1.0), ((1, 2, 3, 4), (1, 2, 9, 4), 0.5), ((1, 2), (1, 2, 3, 4), 0.5), ((), (), 1.0),
     ((5,), (), 0.0), ((1, 2, 3), (9, 2, 3), 0.0)],
)  # fmt: skip
def test__token_agreement__common_prefix_over_longer_answer(ref, out, agreement):
    assert token_agreement(ref, out) == agreement


def test__stage2_only_budgets__spec_arithmetic_with_capacity_S():
    # S = 4096 + 128, t = 256: topk 128, c2 = 16.5, page ceil(sqrt(16.5)) = 5, dims floor(64·5/16.5) = 19
    assert stage2_only_budgets(4096, 128, 256, 64) == {"topk": 128, "page_size": 5, "n_score_dims": 19}
    assert stage2_only_budgets(100, 28, 1024, 64) == {"topk": 512, "page_size": 1, "n_score_dims": 64}


def test__sink_recent_select__sinks_then_most_recent_tokens():
    kept = sink_recent_select(100, 20, 4, 3)
    assert kept.shape == (1, 3, 20)
    assert kept[0, 0].tolist() == [0, 1, 2, 3, *range(84, 100)]
    assert torch.equal(kept[0, 0], kept[0, 2])
    assert sink_recent_select(10, 20, 4, 2)[0, 1].tolist() == list(range(10))
    assert sink_recent_select(100, 6, 10, 1)[0, 0].tolist() == [0, 1, 2, 97, 98, 99]  # sinks ≤ half


def test__prefill_config__selection_validated_and_default_metadata_unchanged():
    with pytest.raises(ValueError, match="selection"):
        PrefillConfig(selection="h2o")
    with pytest.raises(ValueError, match="n_sink_tokens"):
        PrefillConfig(selection="sink_recent", n_sink_tokens=-1)
    d = PrefillConfig().to_dict()
    assert "selection" not in d and "n_sink_tokens" not in d  # what older rocketkv wrote and reads
    assert PrefillConfig(**d) == PrefillConfig()
    sink = PrefillConfig(selection="sink_recent", n_sink_tokens=2)
    assert PrefillConfig(**sink.to_dict()) == sink


def test__sink_recent_cache__saves_loads_and_answers(tmp_path):
    engine = make_engine("llama")
    doc = Document(text_of_bytes(500), "0" * 64, "doc.txt")
    cfg = PrefillConfig(token_budget=64, max_new_tokens=8, window_size=8, selection="sink_recent", n_sink_tokens=4)
    stored = engine.ingest(doc, cfg)
    n = stored.n_context_tokens
    for layer in stored.layers:
        positions = layer.positions
        pb = positions.shape[2]
        assert positions[0, 0].tolist() == [0, 1, 2, 3, *range(n - pb + 4, n)]
    path = save_cache(stored, tmp_path / "s.kv")
    loaded = load_cache(path)
    assert loaded.info.config.selection == "sink_recent"
    a = next(answer(engine, stored, ["Q?"], 4, decode_config_for(stored, sparse=False)))
    b = next(answer(engine, loaded, ["Q?"], 4, decode_config_for(loaded, sparse=False)))
    assert a.token_ids == b.token_ids


@pytest.mark.parametrize("arch", ["llama", "gemma3_text"])
def test__compress_variants__equal_ingest_for_each_config(arch):
    engine = make_engine(arch)
    doc = Document(text_of_bytes(700), "0" * 64, "doc.txt")
    cfgs = [
        PrefillConfig(token_budget=64, max_new_tokens=8, window_size=8),
        PrefillConfig(token_budget=128, max_new_tokens=8, window_size=8, pool_kernel_size=0),  # scores reused
        PrefillConfig(token_budget=64, max_new_tokens=8, window_size=8, observation="probe", pool_kernel_size=0),
        PrefillConfig(token_budget=64, max_new_tokens=8, window_size=24, pool_kernel_size=7),
        PrefillConfig(token_budget=64, max_new_tokens=8, window_size=8, selection="sink_recent"),
        PrefillConfig(token_budget=FULL_TOKEN_BUDGET, max_new_tokens=8, window_size=8),
        PrefillConfig(token_budget=64, max_new_tokens=8, window_size=8, observation="reconstruct", pool_kernel_size=1),
        PrefillConfig(token_budget=32, max_new_tokens=8, window_size=8, store_budget=64),
    ]
    for cfg, many in zip(cfgs, compress_variants(engine, doc, cfgs)):
        one = engine.ingest(doc, cfg)
        assert many.info == one.info
        assert all(same_layer(a, b) for a, b in zip(one.layers, many.layers)), cfg
    with pytest.raises(ValueError, match="chunk_tokens"):
        compress_variants(engine, doc, [cfgs[0], PrefillConfig(chunk_tokens=64)])


def test__plan__one_cache_per_stage1_setting_and_every_method():
    caches, runs = plan(EvalConfig(budgets=(128, 512), observations=("tail", "probe"), pool_kernels=(63, 0)))
    assert set(caches) == {"full", *(f"t{t}-{o}-{k}" for t in (128, 512) for o in ("tail", "probe")
                                      for k in ("63", "auto")), "t128-sink", "t512-sink",
                           *(f"t{t}-{m}" for t in (128, 512) for m in ("reconstruct", "reselect",
                                                                         "reconstruct-reselect", "reconstruct-adaptive",
                                                                         "tail-63-adaptive"))}  # fmt: skip
    assert caches["t512-reselect"].store_budget == 1024 and caches["t128-reconstruct"].observation == "reconstruct"
    labels = Counter(r.label for r in runs)
    assert labels["full"] == 1 and labels["snapkv"] == labels["hsa"] == labels["sink_recent"] == 2
    assert labels["rocketkv[probe,auto]"] == 2 and labels["adaptive"] == labels["reconstruct_adaptive"] == 2
    assert caches["t128-tail-63-adaptive"] == dataclasses.replace(caches["t128-tail-63"], layer_budgets="adaptive")
    snap = [r for r in runs if r.method == "snapkv"]
    assert all(r.cache_key == f"t{r.budget}-tail-63" for r in snap)  # same cache as rocketkv's first variant
    assert {r.cache_key for r in runs if r.method == "hsa"} == {"full"}


@pytest.mark.parametrize(
    "kw", [{"methods": ("full", "h2o")}, {"budgets": ()}, {"pool_kernels": (8,)}, {"context_tokens": (10,)},
           {"samples": 0}, {"observations": ("tail", "tail")}, {"stage2": "dense"},
           {"stage2": "exact", "methods": ("full", "hsa")}],
)  # fmt: skip
def test__eval_config__rejects_bad_values(kw):
    with pytest.raises(ValueError):
        EvalConfig(**kw)


RECORD_KEYS = {
    "context_tokens", "n_context_tokens", "task", "sample", "seed", "question_index", "question", "expected",
    "needle_depths", "method", "label", "budget", "observation", "pool_kernel", "kept_tokens", "stored_tokens",
    "sparse", "topk", "page_size", "n_score_dims", "answer", "token_ids", "n_answer_tokens", "stop_reason", "score",
    "correct", "agreement", "prefill_s", "decode_s", "score_s", "top1_agreement", "kl", "ref_logprob", "generated",
}  # fmt: skip
SUMMARY_KEYS = {"context_tokens", "task", "label", "method", "budget", "observation", "pool_kernel", "score",
                "score_ci", "correct_rate", "correct_ci", "agreement", "top1_agreement", "top1_agreement_ci", "kl",
                "kl_ci", "ref_logprob", "generated", "n"}  # fmt: skip


def test__cli_eval__tiny_model_end_to_end_json_schema(rocketkv_bin, tiny_model_dir, tmp_path):
    # one thread: a tiny model gains nothing from more, and a busy 2-core machine makes them spin (10× slower)
    env = {**os.environ, "ROCKETKV_HOME": str(tmp_path / "home"), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    hay = tmp_path / "hay.txt"
    hay.write_text(HAYSTACK)
    out = tmp_path / "eval.json"
    r = subprocess.run([rocketkv_bin, "eval", "--model", str(tiny_model_dir), "--context-tokens", "300",
                        "--budgets", "64", "--samples", "2", "--tasks", "niah_text,multiquery,fwe",
                        "--observations", "tail,probe", "--window-size", "8", "--max-new-tokens", "3",
                        "--haystack", str(hay), "--json", str(out)],
                       capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    report = json.loads(out.read_text())
    assert set(report) == {"format", "format_version", "config", "model", "versions", "summary", "samples",
                           "records", "elapsed_s", "date"}  # fmt: skip
    assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", report["date"]), report["date"]
    assert len(report["samples"]) == 3 * 2 and all(s["prefill_s"] > 0 for s in report["samples"])
    assert report["format"] == "rocketkv.eval" and report["format_version"] == 1
    assert report["config"]["samples"] == 2 and report["config"]["budgets"] == [64]
    assert report["config"]["haystack"] == str(hay)
    assert set(report["versions"]) >= {"rocketkv", "torch", "transformers", "threads"}
    records = report["records"]
    assert all(set(rec) == RECORD_KEYS for rec in records)
    # questions: niah_text 1 + multiquery 4 + fwe 1, per sample; runs: full, 2 rocketkv, snapkv, hsa, sink_recent,
    # reconstruct, reselect, reconstruct_reselect, adaptive, reconstruct_adaptive
    assert len(records) == 2 * (1 + 4 + 1) * 11
    assert {rec["label"] for rec in records} == {"full", "rocketkv[tail,63]", "rocketkv[probe,63]", "snapkv", "hsa",
                                                  "sink_recent", "reconstruct", "reselect",
                                                  "reconstruct_reselect", "adaptive",
                                                  "reconstruct_adaptive"}  # fmt: skip
    # the file holds more than each question's working set
    for rec in (r for r in records if r["method"] in ("reselect", "reconstruct_reselect")):
        assert rec["kept_tokens"] < rec["stored_tokens"] < rec["n_context_tokens"], rec
    assert all(rec["agreement"] == 1.0 for rec in records if rec["method"] == "full")
    assert all(0 <= rec["score"] <= 1 and 0 <= rec["agreement"] <= 1 for rec in records)
    assert all(rec["kept_tokens"] < rec["n_context_tokens"] for rec in records if rec["method"] not in ("full", "hsa"))
    assert all(rec["sparse"] == (rec["method"] not in ("full", "snapkv", "sink_recent")) for rec in records)
    for rec in records:  # teacher-forced scores of the full-attention answer under every other method
        if rec["method"] == "full":
            assert rec["top1_agreement"] is None and rec["generated"] and rec["score_s"] is None
        else:
            assert 0 <= rec["top1_agreement"] <= 1 and rec["kl"] >= -1e-6 and rec["score_s"] > 0
            if not rec["generated"]:  # agreed everywhere: its greedy answer is full attention's
                assert rec["agreement"] == 1.0 and rec["top1_agreement"] == 1.0
    summary = report["summary"]
    assert all(set(row) == SUMMARY_KEYS for row in summary)
    assert {row["task"] for row in summary} == {"niah_text", "multiquery", "fwe", "mean"}
    stdout_rows = [json.loads(line) for line in r.stdout.splitlines()]
    assert len(stdout_rows) == len(summary)


def test__cli_eval__bad_options_are_one_line_errors(rocketkv_bin, tmp_path):
    env = {**os.environ, "ROCKETKV_HOME": str(tmp_path / "home"), "HF_HUB_OFFLINE": "1"}
    for args, message, code in (
        (["--methods", "full,h2o"], "methods must be", 2),  # a usage error
        (["--tasks", "niah_text", "--haystack", str(tmp_path / "missing.txt")], "not found", 1),
    ):
        r = subprocess.run([rocketkv_bin, "eval", *args], capture_output=True, text=True, env=env, cwd=tmp_path,
                           timeout=120)  # fmt: skip
        assert r.returncode == code, r.stderr
        errors = [line for line in r.stderr.splitlines() if line.startswith("Error:")]
        assert len(errors) == 1 and message in errors[0], r.stderr
        assert r.stdout == ""


def test__wilson_and_bootstrap_intervals():
    from rocketkv_cli.eval.stats import bootstrap_mean, wilson

    lo, hi = wilson(18, 20)  # 90% with n=20: Wilson gives about [0.70, 0.97]
    assert 0.69 < lo < 0.71 and 0.96 < hi < 0.98
    assert wilson(0, 0) == (0.0, 1.0) and wilson(20, 20)[1] == 1.0
    lo, hi = bootstrap_mean([0.0] * 10 + [1.0] * 10)
    assert lo < 0.5 < hi and 0.25 < lo and hi < 0.75
    assert bootstrap_mean([0.3]) == (0.3, 0.3)


def test__teacher_forced_scores__a_method_equal_to_full_attention_agrees_everywhere(tmp_path):
    """`snapkv` with a budget above the document keeps everything and attends exactly: its
    teacher-forced top-1 agreement is 1, KL 0, and its answer is the reference's without generating."""
    engine = make_engine("llama")
    cfg = EvalConfig(context_tokens=(300,), budgets=(100_000,), methods=("full", "snapkv"), tasks=("niah_noise",),
                     samples=1, max_new_tokens=6)  # fmt: skip
    report = run_eval(engine, cfg, tmp_path)
    snap = [r for r in report["records"] if r["method"] == "snapkv"]
    assert snap and all(r["top1_agreement"] == 1.0 and abs(r["kl"]) < 1e-9 and not r["generated"] for r in snap)


def test__stage2_exact__every_pruned_cache_decodes_with_exact_attention(tmp_path):
    """`stage2="exact"` (as `ask` decodes on a CPU): the methods that decode with HSA by default
    attend their pruned caches exactly, and equal `snapkv` over the same cache."""
    engine = make_engine("llama")
    base = dict(context_tokens=(300,), budgets=(64,), tasks=("niah_noise",), samples=1, max_new_tokens=6)
    hsa = run_eval(engine, EvalConfig(methods=("full", "rocketkv"), **base), tmp_path)
    exact = run_eval(engine, EvalConfig(methods=("full", "rocketkv", "snapkv"), stage2="exact", **base), tmp_path)
    assert {r["sparse"] for r in hsa["records"] if r["method"] == "rocketkv"} == {True}
    assert {r["sparse"] for r in exact["records"]} == {False}
    by = {r["method"]: r for r in exact["records"]}
    assert by["rocketkv"]["token_ids"] == by["snapkv"]["token_ids"] and by["rocketkv"]["kl"] == by["snapkv"]["kl"]


def test__accuracy_report__quick_mode_on_a_tiny_model_writes_the_page_and_json(tiny_model_dir, tmp_path):
    """`scripts/accuracy_report.py --quick` (the smoke run of the whole chain: eval per task, the
    merge, the page) on a tiny model: the merged JSON keeps eval's schema and the page says it is
    not evidence."""
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    hay = tmp_path / "hay.txt"
    hay.write_text(HAYSTACK)
    env = {**os.environ, "ROCKETKV_HOME": str(tmp_path / "home"), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    extra = (
        f"--haystack {hay} --window-size 8 --max-new-tokens 3 --budgets 64 --methods full,rocketkv,snapkv "
        "--observations tail"
    )
    r = subprocess.run([sys.executable, str(root / "scripts" / "accuracy_report.py"), "--quick", "--model",
                        str(tiny_model_dir), "--context-tokens", "300", "--tasks", "niah_text,fwe", "--out-dir",
                        str(tmp_path / "out"), "--eval-args", extra],
                       capture_output=True, text=True, env=env, cwd=tmp_path, timeout=600)  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    name = tiny_model_dir.name
    merged = json.loads((tmp_path / "out" / "bench" / f"accuracy-{name}.json").read_text())
    assert merged["format"] == "rocketkv.eval" and merged["config"]["tasks"] == ["niah_text", "fwe"]
    assert all(set(rec) == RECORD_KEYS for rec in merged["records"]) and merged["records"]
    assert all(set(row) == SUMMARY_KEYS for row in merged["summary"])
    assert {row["task"] for row in merged["summary"]} == {"niah_text", "fwe", "mean"}
    assert {rec["label"] for rec in merged["records"]} >= {"full", "snapkv"}
    for task in ("niah_text", "fwe"):  # one eval run per task, kept for resuming
        assert (tmp_path / "out" / "bench" / f"accuracy-{name}-{task}.json").is_file()
    page = (tmp_path / "out" / "accuracy.md").read_text()
    assert "QUICK SMOKE RUN" in page and f"## {tiny_model_dir}" in page, page[:500]
    assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", merged["date"]) and f"on {merged['date']}:" in page


def test__accuracy_report__cost_section_projects_the_measured_seconds_per_sample():
    """`--cost`'s section: seconds per sample (prefill + caches, answers) from the eval JSON's
    sample timings, the one-question task weighted 6 and the four-question one 1 (the report's
    seven tasks), projected to 7 tasks x 20 samples, one process and two (values by hand)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "scripts" / "accuracy_report.py"
    spec = importlib.util.spec_from_file_location("accuracy_report", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    rep = {
        "samples": [{"task": "niah_noise", "prefill_s": 50.0, "save_load_s": 10.0, "total_s": 90.0, "n_caches": 25},
                    {"task": "multiquery", "prefill_s": 70.0, "save_load_s": 10.0, "total_s": 150.0, "n_caches": 25}],
        "records": [{"label": "full", "budget": None}, {"label": "rocketkv", "budget": 128},
                    {"label": "rocketkv", "budget": 128}],
        "versions": {"threads": 1}, "config": {"context_tokens": [4096]},
    }  # fmt: skip
    floor = {"median_s": {"tail window": 12.0, "reconstruct, fast path": 33.0}, "context_tokens": 4100, "threads": 2}
    lines = mod.cost_lines({"smollm2-135m": rep, "two-threads": {**rep, "versions": {"threads": 2}}},
                           {"smollm2-135m": [[floor], [{**floor, "threads": 1}, {**floor, "threads": 1}]]})  # fmt: skip
    rows = [line for line in lines if line.startswith(("| smollm2-135m", "| two-threads"))]
    # per sample (6 x 90 + 150) / 7 = 98.6 s, of which (6 x 60 + 80) / 7 = 62.9 s prefill + caches;
    # 140 x 98.6 s = 3.83 h, over two one-thread processes 1.92 h (not shown for a two-thread measurement)
    assert rows[0] == "| smollm2-135m, 4096 | -, - | 1 | 25 / 2 | 63 s | 36 s | 99 s | 3.8 h | 1.9 h |", rows[0]
    assert rows[1] == "| two-threads, 4096 | -, - | 2 | 25 / 2 | 63 s | 36 s | 99 s | 3.8 h | - |", rows[1]
    # the floor: 140 x 12 s = 28 min, 140 x 33 s = 77 min
    assert rows[2] == "| smollm2-135m, 4100 | - | 1 × 2 | 12.0 s | 33.0 s | 28 min | 77 min |", rows[2]
    # two processes at once, each 12 s / 33 s: the machine delivers a sample every 6 s / 16.5 s
    assert rows[3] == "| smollm2-135m, 4100 | - | 2 × 1 | 6.0 s | 16.5 s | 14 min | 38 min |", rows[3]
    assert "smollm2-135m 60–80 s" in "\n".join(lines)  # how much the same prefill + caches varied


def test__long_documents_report__ceiling_section_counts_each_column():
    """`long_documents_report.py --ceiling`'s table: per depth and overall, the needles found with
    the own segment given, from the default cache of that segment alone and with full attention
    over it; and how many of full attention's finds the default cache keeps (counts by hand)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "scripts" / "long_documents_report.py"
    spec = importlib.util.spec_from_file_location("long_documents_report", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    hits = [  # depth, own segment given, default cache, full attention
        (0.1, False, False, True), (0.1, True, True, True), (0.5, False, True, False), (0.9, False, False, False),
    ]  # fmt: skip
    needles = [{"name": f"N{i}", "number": str(100000 + i), "depth": d, "routed_hit": False, "routed_to_own": True,
                "own_hit": own, "seg_default_hit": seg, "full_hit": full, "full_answer": "999"}
               for i, (d, own, seg, full) in enumerate(hits)]  # fmt: skip
    result = {"preset": "tiny", "segment_tokens": None, "document_tokens": 1000, "n_segments": 2, "ingest_s": 10.0,
              "ingest_tokens_per_s": 100.0, "ingest_peak_rss_bytes": 2**30, "file_bytes": 10**6,
              "full_kv_bytes": 10**7, "needles": needles, "partial_summaries": [], "summarize_s": 1.0,
              "summary": "s"}  # fmt: skip
    segment = {"segment": 0, "n_tokens": 500, "seg_default": {"ingest_s": 5.0}, "full": {"ingest_s": 4.0}}
    result["ceiling"] = {"date": "2026-12-03", "segments": [segment]}
    page = mod.render([result], "python scripts/long_documents_report.py")
    section = page[page.index("## Ceiling") : page.index("## Summaries")]
    assert "| tiny | 10% | 1/2 | 1/2 | 2/2 |" in section, section
    assert "| tiny | 50% | 0/1 | 1/1 | 0/1 |" in section and "| tiny | 90% | 0/1 | 0/1 | 0/1 |" in section, section
    assert "| tiny | all | 1/4 | 2/4 | 2/4 |" in section, section
    assert "the default cache answers 1 of the 2 needles full attention answers (and 1 it misses)" in section
    assert "tiny, N2 (100002): '999'" in section and "tiny, N0" not in section  # full attention's misses only
