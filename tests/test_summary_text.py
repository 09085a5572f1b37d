"""Summaries without a prefill (issue 37): `summarize DOC --extractive` and `--write-from sentences`
read the text and never prefill the document; their summaries and citations equal those made from
an ingested cache of the same text. The model writes from key sentences (`write_from`), checked as
any summary. The tiny random model writes bytes that are never a summary, so its written summaries
fall back to extraction; the real presets' outcomes are in docs/summaries.md."""

import json
import os
import re
import subprocess
from pathlib import Path

import pytest
from conftest import run_in_terminal, strip_ansi

from rocketkv_cli import RocketKV
from rocketkv_cli.api.summaries import summarize_document, text_map
from rocketkv_cli.api.summary_check import extract_sentences
from rocketkv_cli.core.config import PrefillConfig
from rocketkv_cli.errors import UsageError

HARBOR = Path(__file__).parent / "data" / "harbor.txt"


@pytest.fixture(scope="module")
def rk(tiny_model_dir):
    return RocketKV.load(str(tiny_model_dir), device="cpu")


def env():
    return {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}


def run(rocketkv_bin, *args):
    return subprocess.run([rocketkv_bin, *map(str, args)], capture_output=True, text=True, env=env(), timeout=300)


def test__text_map__characters_and_lines_of_the_source():
    text = "one\ntwo three\nfour\n"
    ((c, share),) = text_map(text, start=100, line=7)(4, 13)
    assert (c.start, c.end, c.first_line, c.last_line, c.text, share) == (104, 113, 8, 8, "two three", 1.0)
    ((c, _),) = text_map(text, start=0, line=1)(0, 18)
    assert (c.first_line, c.last_line, c.text) == (1, 3, "one two three four")
    assert text_map(text)(5, 5) == []


def test__written_from_sentences__checked_then_extracted(rk):
    cache = rk.ingest(text=HARBOR.read_text(), token_budget=128, max_new_tokens=8).cache
    s = rk.summarize(cache, max_new_tokens=8, write_from="sentences")
    assert [r.split(":")[0] for r in s.rejected] == ["written", "written-retry"], s.rejected
    assert s.mode == "extractive" and s.text == " ".join(extract_sentences(HARBOR.read_text()))
    with pytest.raises(UsageError, match="write_from"):
        rk.summarize(cache, max_new_tokens=8, write_from="paragraphs")


def test__document_text__as_from_its_cache_and_segmented_alike(rk):
    text = HARBOR.read_text()
    cfg = PrefillConfig(token_budget=128, max_new_tokens=8)
    cache = rk.ingest(text=text, token_budget=128, max_new_tokens=8, segment_tokens=640).cache
    stored, direct = [], []
    from_cache = rk.summarize(cache, max_new_tokens=8, extractive=True, on_partial=stored.append, cite=3)
    from_text = summarize_document(rk.engine, text, cfg, 8, 640, direct.append, extractive=True, cite=True)
    assert len(direct) == len(cache.segments) >= 3
    assert [e.text for e in direct] == [e.text for e in stored]
    assert from_text.text == from_cache.text and from_text.mode == "extractive"
    where = [(c.first_line, c.last_line, c.start, c.end) for c in from_text.citations]
    assert where == [(c.first_line, c.last_line, c.start, c.end) for c in from_cache.citations] and where
    for c in from_text.citations:  # each cited passage is the source's own characters
        assert " ".join(text[c.start : c.end].split()) == c.text
        assert text.count("\n", 0, c.start) + 1 == c.first_line


def test__cli__extractive_document_is_not_prefilled(rocketkv_bin, tiny_model_dir):
    common = ["summarize", HARBOR, "--model", tiny_model_dir, "--max-new-tokens", "8", "--budget", "128",
              "--no-server"]  # fmt: skip
    r = run(rocketkv_bin, *common, "--extractive", "--json", "--cite")
    assert r.returncode == 0, r.stderr
    row = json.loads(r.stdout)
    assert row["mode"] == "extractive" and row["summary"] == " ".join(extract_sentences(HARBOR.read_text()))
    assert row["citations"] and "prefilled" not in r.stderr, r.stderr
    code, shown = run_in_terminal([rocketkv_bin, *map(str, common), "--write-from", "sentences"], env())
    shown = strip_ansi(shown)
    assert code == 0, shown
    assert "prefilled" not in shown and "Traceback" not in shown
    assert "rejected (written:" in shown and re.search(r"extracted sentences", shown), shown
    r = run(rocketkv_bin, *common, "--write-from", "paragraphs")
    assert r.returncode == 2 and "paragraphs" in r.stderr and "Traceback" not in r.stderr
    r = run(rocketkv_bin, *common, "--write-from", "document", "--extractive")
    assert r.returncode == 2 and "contradict" in r.stderr and len(r.stderr.strip().splitlines()) <= 2, r.stderr


def test__cli__a_long_document_summarized_from_itself_names_the_faster_modes(rocketkv_bin, tiny_model_dir, tmp_path):
    """Over 1 MB in document mode: before the long prefill starts, one line says so and names
    --extractive (stopped once it is shown: the prefill itself is not what is tested)."""
    big = tmp_path / "big.txt"
    big.write_text(HARBOR.read_text() * (2 * 1024 * 1024 // len(HARBOR.read_text())))
    proc = subprocess.Popen([rocketkv_bin, "summarize", str(big), "--model", str(tiny_model_dir), "--no-server"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env())  # fmt: skip
    try:
        seen = []
        assert proc.stderr is not None
        for line in proc.stderr:
            seen.append(line)
            if "MB" in line or len(seen) > 20:
                break
    finally:
        proc.kill()
        proc.wait()
    hint = next((line for line in seen if "big.txt is 2.1 MB" in line), None)
    assert hint is not None and "--extractive" in hint and "rocketkv ingest" in hint, seen
    small = run(rocketkv_bin, "summarize", HARBOR, "--model", tiny_model_dir, "--max-new-tokens", "8", "--no-server")
    assert small.returncode == 0 and "MB:" not in small.stderr, small.stderr


def test__outline__cites_each_sentence_in_the_part_it_came_from():
    """A segmented document's extracted final summary: the parts' summaries lack the main names, so
    sentences are taken from the parts' own text; each cites lines of its own part."""
    from rocketkv_cli.api.summaries import outline, trace_sentences

    text0 = "In the spring Anna planted the orchard above the river.\nBoris and Clara carried water up the hill.\n"
    text1 = "The orchard gave fruit in the autumn rains.\nDmitri pressed the apples in the old mill.\n" \
            "Elena sold the cider at the market in town.\n"  # fmt: skip
    maps = [text_map(text0, 0, 1), text_map(text1, len(text0), 3)]
    firsts = ["In the spring Anna planted the orchard above the river.", "The orchard gave fruit in the autumn rains."]
    partials = [(s, trace_sentences([s], t, m)) for s, t, m in zip(firsts, (text0, text1), maps)]
    names = ("Anna", "Boris", "Clara", "Dmitri", "Elena")
    sentences, checked, spans = outline(partials, names, [(text0, maps[0]), (text1, maps[1])], cite=True)
    assert sentences == [firsts[0], "Boris and Clara carried water up the hill.", firsts[1],
                         "Dmitri pressed the apples in the old mill.",
                         "Elena sold the cider at the market in town."], sentences  # fmt: skip
    assert spans is not None and len(spans) == 5
    summary = " ".join(sentences)
    source = text0 + text1
    for start, end, c in spans:  # each piece of the summary cites exactly the lines it was taken from
        assert " ".join(source[c.start : c.end].split()) == summary[start:end], (summary[start:end], c)
        assert c.first_line == c.last_line == source[: c.start].count("\n") + 1
    assert abs(sum(c.weight for _, _, c in spans) - 1) < 1e-9
    assert "Dmitri pressed" in checked and "Anna planted" in checked and "market in town" in checked
