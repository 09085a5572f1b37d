"""A summary is never degenerate (issue 37): the model's output is checked, asked for once more in
another framing, then replaced by extracted sentences; `--extractive` extracts at once.

The tiny random model writes bytes that are never a summary (under 15 words), so every model
summary here falls back to extraction; the real presets' modes are in tests/test_summary_report.py
and docs/summaries.md.
"""

import json
import os
import subprocess
from pathlib import Path

import pytest

from rocketkv_cli import RocketKV
from rocketkv_cli.api.summaries import Summary
from rocketkv_cli.api.summary_check import degenerate_reasons, document_names, extract_sentences, outline_sentences

HARBOR = Path(__file__).parent / "data" / "harbor.txt"


@pytest.fixture(scope="module")
def rk(tiny_model_dir):
    return RocketKV.load(str(tiny_model_dir), device="cpu")


@pytest.fixture(scope="module")
def harbor(rk):
    return rk.ingest(text=HARBOR.read_text(), token_budget=128, max_new_tokens=8).cache


def test__degenerate_model_output__retried_then_extracted(rk, harbor):
    s = rk.summarize(harbor, max_new_tokens=8)
    assert isinstance(s, Summary) and s.mode == "extractive" and s.stop_reason == "extracted"
    assert [r.split(":")[0] for r in s.rejected] == ["abstractive", "abstractive-retry"], s.rejected
    assert s.text == " ".join(extract_sentences(HARBOR.read_text())) and s.n_answer_tokens == 0
    assert degenerate_reasons(s.text, []) == [], s.text  # what is printed passes the rules it replaced


def test__extractive__no_model_writing(rk, harbor):
    s = rk.summarize(harbor, max_new_tokens=8, extractive=True)
    assert s.mode == "extractive" and s.rejected == () and s.token_ids == ()
    assert s.text == " ".join(extract_sentences(HARBOR.read_text()))
    assert "Elias" in s.text  # the story's keeper, named in its central sentences


def test__segmented__each_part_and_the_final_say_their_mode(rk):
    text = HARBOR.read_text()
    cache = rk.ingest(text=text, token_budget=128, max_new_tokens=8, segment_tokens=640).cache
    events = []
    s = rk.summarize(cache, max_new_tokens=8, extractive=True, on_partial=events.append)
    assert len(events) == len(cache.segments) >= 3
    assert all(e.mode == "extractive" and e.level == 0 for e in events)
    outline = outline_sentences([e.text for e in events], document_names(text), [text])
    assert s.mode == "extractive" and s.text == " ".join(outline), (s.text, outline)
    assert len(outline) >= len(events)  # every part's summary gives the final summary a sentence
    assert sum(name in s.text for name in document_names(text)[:5]) >= 5  # the story's main names
    model = []
    s = rk.summarize(cache, max_new_tokens=8, on_partial=model.append)  # the model's parts fall back one by one
    assert [e.mode for e in model] == ["extractive"] * len(events) and [e.text for e in model] == [
        e.text for e in events
    ]
    assert s.mode == "extractive" and len(s.rejected) == 2  # the final condensation, too


def run(rocketkv_bin, *args):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    return subprocess.run([rocketkv_bin, *map(str, args)], capture_output=True, text=True, env=env, timeout=300)


def test__cli__json_mode_and_text_note(rocketkv_bin, tiny_model_dir):
    common = ["summarize", HARBOR, "--model", tiny_model_dir, "--max-new-tokens", "8", "--budget", "128"]
    r = run(rocketkv_bin, *common, "--extractive", "--json")
    assert r.returncode == 0, r.stderr
    row = json.loads(r.stdout)
    expected = " ".join(extract_sentences(HARBOR.read_text()))
    assert row["mode"] == "extractive" and row["summary"] == expected and row["n_answer_tokens"] == 0
    assert "summary: extracted sentences (--extractive)" in r.stderr
    r = run(rocketkv_bin, *common)
    assert r.returncode == 0, r.stderr
    assert r.stdout == expected + "\n"  # stdout is the summary alone; the note is on stderr
    assert "summary: extracted sentences (the model's output was rejected)" in r.stderr
    assert "rejected (abstractive: under 15 words)" in r.stderr


def test__cli__partial_summaries_carry_their_mode(rocketkv_bin, tiny_model_dir):
    r = run(rocketkv_bin, "summarize", HARBOR, "--model", tiny_model_dir, "--max-new-tokens", "8", "--budget", "128",
            "--segment-tokens", "640", "--json", "--extractive")  # fmt: skip
    assert r.returncode == 0, r.stderr
    row = json.loads(r.stdout)
    assert len(row["partial_summaries"]) >= 3 and {p["mode"] for p in row["partial_summaries"]} == {"extractive"}
    assert row["mode"] == "extractive" and "[extractive]" in r.stderr


def test__cli__a_document_without_words__one_line_error(rocketkv_bin, tiny_model_dir, tmp_path):
    numbers = tmp_path / "numbers.txt"
    numbers.write_text("12345 67890 2024\n" * 20)
    r = run(rocketkv_bin, "summarize", numbers, "--model", tiny_model_dir, "--max-new-tokens", "8", "--extractive")
    errors = [line for line in r.stderr.splitlines() if line.startswith("Error:")]
    assert r.returncode == 1 and "Traceback" not in r.stderr and r.stdout == "", r.stderr
    assert len(errors) == 1 and "no sentence to extract a summary from" in errors[0], r.stderr


def test__rejection_reasons__the_summary_checks_rules_on_a_model_written_summary():
    from rocketkv_cli.api.summaries import rejection_reasons

    source = HARBOR.read_text()
    good = " ".join(extract_sentences(source))  # extracted: grounded, and covering by construction
    assert rejection_reasons(good, source) == []
    made_up = ("Then Zorblax the Magnificent sailed his quantum submarine to the moons of Neptune, where the "
               "crew of Zorblax found glowing crystals, silver fish and a silent city under the ice.")  # fmt: skip
    reasons = rejection_reasons(made_up, source)
    assert any(r.startswith("not grounded") and "Zorblax" in r for r in reasons), reasons
    assert any(r.startswith("names 0 of the text's") for r in reasons), reasons
    assert rejection_reasons(made_up, None) == []  # no source text (an old file): only the degenerate rules
    assert "under 15 words" in rejection_reasons("Summary.", source)
