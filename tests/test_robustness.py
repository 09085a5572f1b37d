"""Loader fuzzing, concurrent readers, a writer replacing a file under readers, determinism, no pickle."""

import ast
import dataclasses
import inspect
import json
import os
import subprocess
import threading
from pathlib import Path

import pytest
import torch
from conftest import make_engine, same_layer, text_of_bytes
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rocketkv_cli.core.config import PrefillConfig
from rocketkv_cli.engine.documents import Document
from rocketkv_cli.errors import CacheFormatError
from rocketkv_cli.store.format import load_cache, read_metadata, save_cache

PACKAGE = Path(inspect.getfile(load_cache)).parent


def small_cache(seed=0):
    engine = make_engine("llama", torch.float32)
    document = Document(text=text_of_bytes(200, seed), sha256=f"{seed:064x}", source="doc.txt")
    return engine.ingest(document, PrefillConfig(token_budget=16, max_new_tokens=4, window_size=4))


@pytest.fixture(scope="module")
def valid_bytes(tmp_path_factory):
    path = save_cache(small_cache(), tmp_path_factory.mktemp("fuzz") / "valid.kv")
    return Valid(path.read_bytes(), load_cache(path))


class Valid(tuple):
    """(bytes, loaded cache) with a short repr for hypothesis reports."""

    def __new__(cls, data, cache):
        return super().__new__(cls, (data, cache))

    def __repr__(self):
        return f"<valid cache file, {len(self[0])} bytes>"


def same(a, b):
    """Same cache contents (the save time differs between saves)."""
    info = lambda c: dataclasses.replace(c.info, created_at=None)  # noqa: E731
    return info(a) == info(b) and all(same_layer(la, lb) for la, lb in zip(a.layers, b.layers))


mutation = st.one_of(
    st.tuples(st.just("flip"), st.integers(0, 10**9), st.integers(1, 255)),
    st.tuples(st.just("cut"), st.integers(0, 10**9), st.just(0)),
    st.tuples(st.just("insert"), st.integers(0, 10**9), st.integers(0, 255)),
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(mutations=st.lists(mutation, min_size=1, max_size=4))
def test__fuzz__mutated_cache_raises_own_error_or_loads_identical(valid_bytes, tmp_path, mutations):
    data, original = valid_bytes
    buf = bytearray(data)
    for kind, at, value in mutations:
        at %= max(len(buf), 1)
        if kind == "flip" and buf:
            buf[at] ^= value
        elif kind == "cut":
            del buf[at:]
        else:
            buf.insert(at, value)
    path = tmp_path / "mutated.kv"
    path.write_bytes(bytes(buf))
    try:
        loaded = load_cache(path)
    except CacheFormatError:
        return
    assert same(loaded, original), "a damaged file loaded as a different cache"


def test__writer_replacing_file__readers_see_old_or_new_never_partial(tmp_path):
    a, b = small_cache(0), small_cache(1)
    path = save_cache(a, tmp_path / "shared.kv")
    ref = [load_cache(save_cache(x, tmp_path / f"ref{i}.kv")) for i, x in enumerate((a, b))]
    stop, seen, problems = threading.Event(), [], []

    def reader():
        while not stop.is_set():
            try:
                got = load_cache(path)
                seen.append(0 if same(got, ref[0]) else 1 if same(got, ref[1]) else -1)
            except Exception as exc:  # any error here is a bug: the file must always be whole
                problems.append(repr(exc))

    threads = [threading.Thread(target=reader) for _ in range(2)]
    for t in threads:
        t.start()
    for i in range(30):
        save_cache(b if i % 2 == 0 else a, path, force=True)
    stop.set()
    for t in threads:
        t.join()
    assert not problems and seen and -1 not in seen
    assert not list(tmp_path.glob("*.tmp"))


def _env(tmp_path):
    return {**os.environ, "ROCKETKV_HOME": str(tmp_path / "home"), "HF_HUB_OFFLINE": "1"}


def test__four_concurrent_ask_processes__same_answers_as_one(rocketkv_bin, tiny_model_dir, tmp_path):
    env = _env(tmp_path)
    doc = tmp_path / "doc.txt"
    doc.write_text(text_of_bytes(500) + " The code is 4242.")
    kv = tmp_path / "doc.kv"
    subprocess.run([rocketkv_bin, "ingest", doc, "-o", kv, "--model", tiny_model_dir, "--budget", "64", "-q"],
                   check=True, env=env, capture_output=True)  # fmt: skip
    cmd = [rocketkv_bin, "ask", "--cache", str(kv), "What is the code?", "Which word?", "--json", "-q",
           "--max-new-tokens", "8"]  # fmt: skip
    single = subprocess.run(cmd, capture_output=True, text=True, env=env, check=True).stdout
    procs = [
        subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env) for _ in range(4)
    ]
    outs = [p.communicate(timeout=300) for p in procs]
    assert all(p.returncode == 0 for p in procs), [o[1] for o in outs]
    answers = lambda text: [json.loads(x)["answer"] for x in text.splitlines()]  # noqa: E731
    assert all(answers(o[0]) == answers(single) for o in outs)


def test__same_document_and_settings__identical_cache_but_creation_time(rocketkv_bin, tiny_model_dir, tmp_path):
    env = _env(tmp_path)
    doc = tmp_path / "doc.txt"
    doc.write_text(text_of_bytes(700, seed=3))
    paths = [tmp_path / "a.kv", tmp_path / "b.kv"]
    for p in paths:
        subprocess.run([rocketkv_bin, "ingest", doc, "-o", p, "--model", tiny_model_dir, "--budget", "64", "-q"],
                       check=True, env=env, capture_output=True)  # fmt: skip
    a, b = (load_cache(p) for p in paths)
    assert all(same_layer(la, lb) for la, lb in zip(a.layers, b.layers))
    drop = {"created_at", "metadata_sha256"}
    meta_a, meta_b = (read_metadata(p) for p in paths)
    assert {k: v for k, v in meta_a.items() if k not in drop} == {k: v for k, v in meta_b.items() if k not in drop}


def test__no_pickle_in_the_package():
    for path in sorted(PACKAGE.rglob("*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                names = [a.name for a in node.names] + [getattr(node, "module", None) or ""]
                assert not any(n.split(".")[0] in ("pickle", "dill", "joblib") for n in names), path
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "torch":
                assert node.attr not in ("save", "load"), f"{path}: torch.{node.attr}"


def test__trust_remote_code_off_by_default():
    from rocketkv_cli.cli.ask import ask_command
    from rocketkv_cli.cli.ingest import ingest_command
    from rocketkv_cli.cli.summarize import summarize_command
    from rocketkv_cli.engine.api import RocketKV
    from rocketkv_cli.model.loading import load_model

    for fn in (load_model, RocketKV.load, ingest_command, ask_command, summarize_command):
        assert inspect.signature(fn).parameters["trust_remote_code"].default is False, fn
