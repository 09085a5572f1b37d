"""`scripts/summary_check_report.py --quick` (issue 37): the installed CLI summarizes the GPL with
gemma-3-270m (real weights) and the check is applied. What is printed is never degenerate; an
extracted summary is the GPL's central sentences verbatim. Slow (about a minute): `real_model`."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import SHARED_DATA

from rocketkv_cli.api.summary_check import check_summary, extract_sentences

pytestmark = pytest.mark.real_model

ROOT = Path(__file__).resolve().parents[1]


def test__quick_report__gpl_on_gemma_is_never_degenerate(tmp_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "ROCKETKV_SHARED_DATA": str(SHARED_DATA)}
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "summary_check_report.py"), "--quick", "--data",
                        str(SHARED_DATA), "--out", str(tmp_path / "page.md"), "--json", str(tmp_path / "rows.json")],
                       capture_output=True, text=True, env=env, timeout=900)  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    (row,) = json.loads((tmp_path / "rows.json").read_text())["records"]
    assert (row["document"], row["preset"], row["run"]) == ("gpl", "gemma-3-270m", "model")
    assert row["check"]["degenerate"] == [], row  # the CLI's promise: never a degenerate result
    gpl = (SHARED_DATA / "gpl-3.txt").read_text()
    assert (
        row["check"]
        == check_summary(row["summary"], gpl, [p.read_text() for p in (ROOT / "prompts").glob("*.txt")]).to_dict()
    )
    assert row["mode"] in ("abstractive", "abstractive-retry", "extractive")
    if row["mode"] == "extractive":
        assert row["summary"] == " ".join(extract_sentences(gpl)) and len(row["rejected"]) == 2
    page = (tmp_path / "page.md").read_text()
    line = f"| gpl | gemma-3-270m | model | {row['mode']} | {row['words']} |"
    assert "QUICK SMOKE RUN" in page and line in page and line in r.stdout, page


def test__preset_default__extracts_without_prefilling_in_a_pipe_and_a_terminal(tmp_path):
    """The presets' measured default (`core.config.summary_writing`): a DOC is summarized from its
    text, extracted, and stderr says why; `--write-from document` has the model write (and prefill)."""
    from conftest import run_in_terminal, strip_ansi

    doc = ROOT / "tests" / "data" / "harbor.txt"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    rocketkv = str(Path(sys.executable).parent / "rocketkv")
    r = subprocess.run([rocketkv, "summarize", str(doc), "--json", "--no-server"], capture_output=True, text=True,
                       env=env, timeout=600)  # fmt: skip
    assert r.returncode == 0, r.stderr
    row = json.loads(r.stdout)
    assert row["mode"] == "extractive" and row["rejected"] == [] and "prefilled" not in r.stderr, r.stderr
    assert row["summary"] == " ".join(extract_sentences(doc.read_text()))
    assert "measured default" in r.stderr and "--write-from document" in r.stderr, r.stderr
    code, shown = run_in_terminal([rocketkv, "summarize", str(doc), "--no-server", "--write-from", "document",
                                   "--max-new-tokens", "32"], env)  # fmt: skip
    shown = strip_ansi(shown)
    assert code == 0 and "Traceback" not in shown, shown
    assert "measured default" not in shown and "prefilled" in shown, shown  # the model read the document
