"""`rocketkv batch --ray` and scripts/ray_example.py on a real local Ray cluster started here
(`ray.init(num_cpus=2)`): the same results as the local run. Marker `ray`; needs the `ray` extra
(`.ci/run` installs it; elsewhere the module is skipped when Ray is missing, except under CI)."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import text_of_bytes
from test_batch import answers_by_key, lines_of, run, write_manifest

pytestmark = pytest.mark.ray
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # read at import: the cluster stays on 127.0.0.1
if not os.environ.get("CI"):
    pytest.importorskip("ray.data")
import ray  # noqa: E402  (under CI a missing Ray is an error, not a skip)

ROOT = Path(__file__).resolve().parents[1]
OPTS = ["--budget", "64", "--max-new-tokens", "12"]


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    home = tmp_path_factory.mktemp("rkv-home")
    return {**os.environ, "ROCKETKV_HOME": str(home), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="module")
def cluster():
    """A local 2-CPU Ray cluster (on the loopback address); yields its address for other
    processes to join."""
    ray.init(num_cpus=2, include_dashboard=False, logging_level=logging.ERROR)
    try:
        address = ray.get_runtime_context().gcs_address
        assert address.startswith("127.0.0.1:"), address
        yield address
    finally:
        ray.shutdown()


@pytest.fixture(scope="module")
def docs(tmp_path_factory):
    root = tmp_path_factory.mktemp("ray-docs")
    folder = root / "docs"
    folder.mkdir()
    for i in range(4):
        (folder / f"d{i}.txt").write_text(text_of_bytes(1000, seed=40 + i % 3) + f"\nThe code is {i % 3}{i % 3}.\n")
    return root, folder


def test__ray_batch__results_equal_the_local_run(cluster, docs, rocketkv_bin, env, tiny_model_dir):
    root, folder = docs
    rows = [{"id": p.stem, "document": str(p), "questions": ["What is the code?", "Who?"]}
            for p in sorted(folder.glob("*.txt"))]  # fmt: skip
    rows += [{"id": "missing", "document": str(folder / "nope.txt"), "questions": ["What?"]}]
    manifest = write_manifest(root / "m.jsonl", rows)
    common = ["batch", manifest, "--model", tiny_model_dir, *OPTS]
    local = run(rocketkv_bin, env, *common, "-o", root / "local.jsonl", "--cache-dir", root / "local-cache")
    on_ray = run(rocketkv_bin, env, *common, "-o", root / "ray.jsonl", "--cache-dir", root / "ray-cache",
                 "--ray", cluster, "--workers", "2")  # fmt: skip
    for r in (local, on_ray):
        assert r.returncode == 1 and "1 row failed" in r.stderr and "Traceback" not in r.stderr, r.stderr
    answered = [line for line in lines_of(root / "ray.jsonl") if "error" not in line]
    errors = [line for line in lines_of(root / "ray.jsonl") if "error" in line]
    assert errors == [line for line in lines_of(root / "local.jsonl") if "error" in line]
    ray_results = root / "ray-answers.jsonl"
    ray_results.write_text("".join(json.dumps(line) + "\n" for line in answered))
    local_results = root / "local-answers.jsonl"
    local_results.write_text("".join(json.dumps(x) + "\n" for x in lines_of(root / "local.jsonl") if "error" not in x))
    assert answers_by_key(ray_results) == answers_by_key(local_results) and len(answered) == 8
    assert sorted(p.name for p in (root / "ray-cache").glob("*.kv")) == sorted(
        p.name for p in (root / "local-cache").glob("*.kv")
    )  # the actors wrote the same build cache, d0 and d3 (equal text) sharing one file
    assert len(list((root / "ray-cache").glob("*.kv"))) == 3


def test__ray_example_script__answers_through_the_python_api(cluster, docs, tiny_model_dir, tmp_path):
    _, folder = docs
    out = tmp_path / "answers"
    cmd = [sys.executable, str(ROOT / "scripts" / "ray_example.py"), "--docs", str(folder), "--question",
           "What is the code?", "--out", str(out), "--model", str(tiny_model_dir), "--address", cluster,
           "--cache-dir", str(tmp_path / "kv"), "--budget", "64", "--max-new-tokens", "12", "--actors", "2",
           "--actor-cpus", "0.5"]  # fmt: skip
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [json.loads(line) for f in sorted(out.glob("*.json")) for line in f.read_text().splitlines()]
    assert sorted(row["path"].rsplit("/", 1)[-1] for row in rows) == [f"d{i}.txt" for i in range(4)]
    assert all(row["error"] == "" and row["question"] == "What is the code?" for row in rows)
    assert len(list((tmp_path / "kv").glob("*.kv"))) == 3


def test__ray_address_nothing_listens_on__one_line_in_seconds(rocketkv_bin, env, tiny_model_dir, tmp_path):
    """`--ray HOST:PORT` with no cluster there: one line and exit 1 within seconds (Ray itself
    retried for minutes, printing its own log lines)."""
    import socket
    import time

    with socket.socket() as s:  # a free port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    manifest = write_manifest(tmp_path / "m.jsonl", [{"id": "a", "text": "The sky is blue.", "questions": ["Q?"]}])
    t0 = time.monotonic()
    r = run(rocketkv_bin, env, "batch", manifest, "-o", tmp_path / "r.jsonl", "--model", tiny_model_dir,
            "--ray", f"127.0.0.1:{port}")  # fmt: skip
    errors = [line for line in r.stderr.splitlines() if line.startswith("Error:")]
    assert r.returncode == 1 and len(errors) == 1 and "cannot reach a Ray cluster" in errors[0], r.stderr
    assert time.monotonic() - t0 < 60 and "Traceback" not in r.stderr
