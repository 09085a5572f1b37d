"""`summarize --cite`: each summary (each part's and the final one) lists the passages of the
document it came from. With --extractive every sentence is cited by the lines it was extracted
from, so each citation is checked against the document's own lines (not against the code's output).
"""

import json
import os
import subprocess
from pathlib import Path

from conftest import run_in_terminal, strip_ansi

from rocketkv_cli.api.summary_check import extract_sentences, split_sentences

HARBOR = Path(__file__).parent / "data" / "harbor.txt"
OLD = Path(__file__).parent / "data" / "v1-llama.kv"  # written by rocketkv 0.1.0, before token offsets


def env() -> dict:
    return {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}


def run(rocketkv_bin, *args):
    return subprocess.run([rocketkv_bin, *map(str, args)], capture_output=True, text=True, env=env(), timeout=300)


def common(tiny_model_dir, *more):
    return ["summarize", HARBOR, "--model", tiny_model_dir, "--max-new-tokens", "8", "--budget", "128", *more]


def flat(text: str) -> str:
    return " ".join(text.split())


def lines_of(first: int, last: int) -> str:
    return flat(" ".join(HARBOR.read_text().split("\n")[first - 1 : last]))


def check_cited(summary: str, citations: list[dict]) -> None:
    """Each extracted sentence is held by one cited line range, and each citation's characters
    [start, end) are its text, no whitespace around it, and lie on its lines (checked on the
    document itself)."""
    text = HARBOR.read_text()
    assert citations
    assert [(c["line"], c["start"]) for c in citations] == sorted((c["line"], c["start"]) for c in citations)
    for c in citations:
        assert flat(text[c["start"] : c["end"]]) == c["text"] != ""
        assert text[c["start"] : c["end"]] == text[c["start"] : c["end"]].strip(), c
        assert c["line"] == text[: c["start"]].count("\n") + 1 and c["end_line"] >= c["line"]
        assert 0 < c["weight"] <= 1
    for sentence in summary_sentences(summary):
        assert any(sentence in lines_of(c["line"], c["end_line"]) and sentence in c["text"] for c in citations), (
            sentence, citations)  # fmt: skip
    assert abs(sum(c["weight"] for c in citations) - 1) < 1e-3


def summary_sentences(summary: str) -> list[str]:
    """The sentences extraction picked from harbor.txt (known independently of the summary's citations)."""
    picked = extract_sentences(HARBOR.read_text())
    assert summary == " ".join(picked)
    return picked


def test__extractive_json__each_sentence_cited_by_its_lines(rocketkv_bin, tiny_model_dir):
    r = run(rocketkv_bin, *common(tiny_model_dir, "--extractive", "--cite", "--json"))
    assert r.returncode == 0, r.stderr
    row = json.loads(r.stdout)
    assert row["mode"] == "extractive"
    check_cited(row["summary"], row["citations"])
    assert len(row["citations"]) == len(summary_sentences(row["summary"]))  # one passage per sentence, not --passages
    assert {c["line"] for c in row["citations"]} <= {3, 5, 7, 9, 11}  # harbor's paragraphs, never the title


def test__without_cite__no_citations(rocketkv_bin, tiny_model_dir):
    r = run(rocketkv_bin, *common(tiny_model_dir, "--extractive", "--json"))
    assert r.returncode == 0, r.stderr
    assert "citations" not in json.loads(r.stdout)


def test__extractive_text__sources_after_the_summary_as_ask_prints_them(rocketkv_bin, tiny_model_dir):
    cited = json.loads(run(rocketkv_bin, *common(tiny_model_dir, "--extractive", "--cite", "--json")).stdout)
    r = run(rocketkv_bin, *common(tiny_model_dir, "--extractive", "--cite"))
    assert r.returncode == 0, r.stderr
    summary, sources = r.stdout.split("\nSources:\n")
    assert summary == " ".join(extract_sentences(HARBOR.read_text()))
    rows = sources.splitlines()
    assert [row.split(" (")[0] for row in rows] == [
        f"  [{i}] {'line' if c['line'] == c['end_line'] else 'lines'} {c['line']}"
        f"{'' if c['line'] == c['end_line'] else '-' + str(c['end_line'])}, characters {c['start']}-{c['end']}"
        for i, c in enumerate(cited["citations"], 1)
    ]
    assert all(row.endswith(": " + c["text"]) for row, c in zip(rows, cited["citations"]))


def test__in_a_terminal__sources_shown(rocketkv_bin, tiny_model_dir):
    code, shown = run_in_terminal([rocketkv_bin, *map(str, common(tiny_model_dir, "--extractive", "--cite"))], env())
    shown = strip_ansi(shown).replace("\r\n", "\n")
    assert code == 0, shown
    assert "Traceback" not in shown and "\nSources:\n" in shown
    first = extract_sentences(HARBOR.read_text())[0]
    assert any(row.startswith("  [1] line ") and first in row for row in shown.splitlines()), shown


def test__segmented__each_part_and_the_final_cite_the_document(rocketkv_bin, tiny_model_dir):
    r = run(rocketkv_bin, *common(tiny_model_dir, "--segment-tokens", "640", "--extractive", "--cite", "--json"))
    assert r.returncode == 0, r.stderr
    row = json.loads(r.stdout)
    parts = row["partial_summaries"]
    assert len(parts) >= 3 and all(p["citations"] for p in parts)
    text = HARBOR.read_text()
    for p in [*parts, row]:
        cits = p["citations"]
        assert [(c["line"], c["start"]) for c in cits] == sorted((c["line"], c["start"]) for c in cits)
        for sentence in split_sentences(p["summary"]):
            assert any(sentence in lines_of(c["line"], c["end_line"]) for c in cits), (sentence, cits)
        for c in cits:
            assert flat(text[c["start"] : c["end"]]) == c["text"]
            assert text[c["start"] : c["end"]] == text[c["start"] : c["end"]].strip(), c
    final_passages = {(c["start"], c["end"]) for c in row["citations"]}
    assert final_passages <= {(c["start"], c["end"]) for p in parts for c in p["citations"]}
    assert "Sources:" in r.stderr  # each part's sources shown under it on stderr


def test__model_written_or_not__cite_never_fails(rocketkv_bin, tiny_model_dir):
    """The tiny model's output is rejected, so the extracted fallback is cited; the attention
    machinery ran while the model wrote (captured, then discarded with the output)."""
    r = run(rocketkv_bin, *common(tiny_model_dir, "--cite", "--json"))
    assert r.returncode == 0, r.stderr
    row = json.loads(r.stdout)
    assert row["mode"] == "extractive" and len(row["rejected"]) == 2
    check_cited(row["summary"], row["citations"])


def test__old_cache_without_offsets__the_error_ask_gives(rocketkv_bin, tiny_model_dir):
    asked = run(rocketkv_bin, "ask", "--cache", OLD, "q?", "--cite", "--no-server")
    from rocketkv_cli.api.rocketkv import read_cache
    from rocketkv_cli.api.summaries import extractable

    assert not extractable(read_cache(OLD))  # so a preset would write from it, not extract (summary_writing)
    r = run(rocketkv_bin, "summarize", "--cache", OLD, "--cite", "--no-server")
    errors = [line for line in r.stderr.splitlines() if line.startswith("Error:")]
    assert r.returncode == 1 == asked.returncode and "Traceback" not in r.stderr and r.stdout == "", r.stderr
    assert len(errors) == 1 and "token offsets" in errors[0], r.stderr
    assert errors == [line for line in asked.stderr.splitlines() if line.startswith("Error:")]
    assert "loaded" not in r.stderr  # refused before any model loads


def test__server__the_same_citations_as_in_process(rocketkv_bin, tiny_model_dir, tmp_path):
    from test_serve import Served, health

    kv = tmp_path / "harbor.kv"
    environ = {**env(), "ROCKETKV_HOME": str(tmp_path / "home"), "ROCKETKV_THREADS": "1"}
    made = subprocess.run([rocketkv_bin, "ingest", str(HARBOR), "-o", str(kv), "--model", str(tiny_model_dir),
                           "--budget", "128"], capture_output=True, text=True, env=environ, timeout=300)  # fmt: skip
    assert made.returncode == 0, made.stderr
    args = [rocketkv_bin, "summarize", "--cache", str(kv), "--extractive", "--cite"]
    local = [subprocess.run([*args, *more, "--no-server"], capture_output=True, text=True, env=environ, timeout=300)
             for more in (["--json"], [])]  # fmt: skip
    s = Served(rocketkv_bin, environ, "--idle-timeout", "0")
    try:
        remote = [subprocess.run([*args, *more], capture_output=True, text=True, env=environ, timeout=300)
                  for more in (["--json"], [])]  # fmt: skip
        assert health(s.server)["served"] == 2  # both were summarized by the server
    finally:
        s.stop()
    drop = lambda out: {k: v for k, v in json.loads(out).items() if k != "summarize_s"}  # noqa: E731
    assert all(r.returncode == 0 for r in local + remote), [r.stderr for r in local + remote]
    assert drop(remote[0].stdout) == drop(local[0].stdout) and drop(local[0].stdout)["citations"]
    assert remote[1].stdout == local[1].stdout and "\nSources:\n" in local[1].stdout


def test__api_summarize__cite_gives_the_extracted_sentences_lines():
    """The Python API takes `cite` as the CLI does: each extracted sentence of the summary lies in
    the lines one of its citations names (checked against the document's own lines)."""
    from conftest import make_engine

    from rocketkv_cli.api.rocketkv import RocketKV

    rk = RocketKV(make_engine("llama"))
    cache = rk.ingest(text=HARBOR.read_text(), token_budget=128, max_new_tokens=8).cache
    summary = rk.summarize(cache, max_new_tokens=8, extractive=True, cite=2)
    assert summary.mode == "extractive" and summary.citations
    for sentence in split_sentences(summary.text):
        assert any(flat(sentence) in lines_of(c.first_line, c.last_line) for c in summary.citations), sentence
    assert rk.summarize(cache, max_new_tokens=8, extractive=True).citations in (None, ())


def test__options_that_cannot_apply__say_so_on_stderr(rocketkv_bin, tiny_model_dir, tmp_path):
    """`--max-new-tokens` beside extracted sentences, `--encoding` beside a cache: each used to be
    ignored silently; now a line on stderr says so (in a pipe and a terminal), the summary unchanged."""
    kv = tmp_path / "harbor.kv"
    made = run(rocketkv_bin, "ingest", HARBOR, "-o", kv, "--model", tiny_model_dir, "--budget", "128")
    assert made.returncode == 0, made.stderr
    plain = run(rocketkv_bin, "summarize", "--cache", kv, "--extractive")
    noted = run(rocketkv_bin, "summarize", "--cache", kv, "--extractive", "--max-new-tokens", "40", "--encoding",
                "latin-1")  # fmt: skip
    assert plain.returncode == 0 and noted.returncode == 0, plain.stderr + noted.stderr
    assert noted.stdout == plain.stdout
    notes = ["--max-new-tokens limits what the model writes; extracted sentences are not limited by it",
             f"--encoding applies to a DOC read here; {kv} holds the document as it was ingested"]  # fmt: skip
    assert all(n in noted.stderr for n in notes) and not any(n in plain.stderr for n in notes), noted.stderr
    code, shown = run_in_terminal([rocketkv_bin, "summarize", "--cache", str(kv), "--extractive", "--max-new-tokens",
                                   "40"], env())  # fmt: skip
    screen = " ".join(strip_ansi(shown).split())
    assert code == 0 and notes[0] in screen and "Traceback" not in screen, screen[-2000:]
