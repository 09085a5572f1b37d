"""The commands users type, run in a pseudo-terminal: Rich draws progress bars and spinners only
when stderr is a terminal, which no piped test exercises (a crash hid there: issue 16 item 1)."""

import os

import pytest
from conftest import run_in_terminal, strip_ansi, text_of_bytes

BAR, SPINNER = "━", "⠋⠙⠹⠸⠼⠴⠦⠧⠇⠏"


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    home = tmp_path_factory.mktemp("rkv-home")
    return {**os.environ, "ROCKETKV_HOME": str(home), "HF_HUB_OFFLINE": "1"}


@pytest.fixture(scope="module")
def doc(tmp_path_factory):
    path = tmp_path_factory.mktemp("tty") / "doc.txt"
    path.write_text(text_of_bytes(2500) + "\nThe secret code is 4242.\n")
    return path


def check_terminal_run(code: int, shown: str, want_bar: bool = True) -> list[str]:
    """Exit 0, a bar (or spinner) drawn, and every log line starting a line of its own.

    Returns the visible lines (ANSI escapes removed, split at carriage returns and newlines)."""
    assert code == 0, shown[-3000:]
    plain = strip_ansi(shown)
    assert "Error:" not in plain and "Traceback" not in plain, plain[-3000:]
    if want_bar:
        assert BAR in plain, f"no progress bar drawn: {plain[-2000:]!r}"
    else:
        assert BAR in plain or any(ch in plain for ch in SPINNER), f"no spinner drawn: {plain[-2000:]!r}"
    lines = [line for line in plain.replace("\r\n", "\n").replace("\r", "\n").split("\n")]
    glued = [line for line in lines if "rocketkv:" in line and not line.lstrip().startswith("rocketkv:")]
    assert not glued, f"log lines glued to another line: {glued[:3]}"
    return lines


@pytest.fixture(scope="module")
def kv(rocketkv_bin, env, doc, tiny_model_dir):
    out = doc.parent / "doc.kv"
    argv = [rocketkv_bin, "ingest", str(doc), "-o", str(out), "--model", str(tiny_model_dir), "--budget", "64",
            "--max-new-tokens", "6", "--chunk-tokens", "256"]  # fmt: skip
    code, shown = run_in_terminal(argv, env)
    lines = check_terminal_run(code, shown)
    assert str(out) in lines and out.is_file()
    return out


def test__ingest_in_a_terminal__draws_the_prefill_bar(kv):
    assert kv.stat().st_size > 0


def test__segmented_ingest_in_a_terminal(rocketkv_bin, env, doc, tiny_model_dir, tmp_path):
    out = tmp_path / "seg.kv"
    code, shown = run_in_terminal([rocketkv_bin, "ingest", str(doc), "-o", str(out), "--model", str(tiny_model_dir),
                                   "--budget", "64", "--segment-tokens", "800"], env)  # fmt: skip
    lines = check_terminal_run(code, shown)
    assert any("segment 1: prefilled" in line for line in lines), lines


def test__ask_from_cache_in_a_terminal(rocketkv_bin, env, kv):
    code, shown = run_in_terminal([rocketkv_bin, "ask", "--cache", str(kv), "What is the code?"], env)
    check_terminal_run(code, shown, want_bar=False)


def test__ask_document_in_a_terminal(rocketkv_bin, env, doc, tiny_model_dir):
    code, shown = run_in_terminal([rocketkv_bin, "ask", str(doc), "What is the code?", "--model", str(tiny_model_dir),
                                   "--max-new-tokens", "4"], env)  # fmt: skip
    check_terminal_run(code, shown)


def test__summarize_in_a_terminal(rocketkv_bin, env, doc, tiny_model_dir):
    code, shown = run_in_terminal([rocketkv_bin, "summarize", str(doc), "--model", str(tiny_model_dir),
                                   "--max-new-tokens", "4"], env)  # fmt: skip
    check_terminal_run(code, shown)


def test__eval_in_a_terminal(rocketkv_bin, env, tiny_model_dir):
    code, shown = run_in_terminal([rocketkv_bin, "eval", "--model", str(tiny_model_dir), "--context-tokens", "300",
                                   "--budgets", "96", "--methods", "full,rocketkv", "--tasks", "niah_noise",
                                   "--samples", "1", "--max-new-tokens", "4"], env)  # fmt: skip
    check_terminal_run(code, shown)


def test__bench_in_a_terminal(rocketkv_bin, env, doc, tiny_model_dir):
    code, shown = run_in_terminal([rocketkv_bin, "bench", "--model", str(tiny_model_dir), "--context-tokens", "300",
                                   "--source", str(doc), "--steps", "2", "--no-memory"], env)  # fmt: skip
    check_terminal_run(code, shown)
