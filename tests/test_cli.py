"""The installed `rocketkv` CLI, run in subprocesses against a saved tiny model (README: Command line contract)."""

import json
import os
import subprocess

import pytest
from conftest import text_of_bytes


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    home = tmp_path_factory.mktemp("rkv-home")
    return {**os.environ, "ROCKETKV_HOME": str(home), "HF_HUB_OFFLINE": "1"}


@pytest.fixture(scope="module")
def doc(tmp_path_factory):
    path = tmp_path_factory.mktemp("docs") / "doc.txt"
    path.write_text(text_of_bytes(600) + "\nThe secret code is 4242.\n")
    return path


def run(rocketkv_bin, env, *args, stdin=None, cwd=None):
    return subprocess.run([rocketkv_bin, *map(str, args)], capture_output=True, text=True, env=env, input=stdin,
                          cwd=cwd, timeout=300)  # fmt: skip


def assert_one_line_error(result, code=1):
    assert result.returncode == code, (result.returncode, result.stderr)
    assert "Traceback" not in result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1, result.stderr
    assert result.stdout == ""
    return errors[0]


@pytest.fixture(scope="module")
def kv(rocketkv_bin, env, doc, tiny_model_dir):
    out = doc.parent / "doc.kv"
    r = run(rocketkv_bin, env, "ingest", doc, "-o", out, "--model", tiny_model_dir, "--budget", "64",
            "--max-new-tokens", "6")  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == str(out)
    return out


def test__ingest_then_ask_json__one_object_per_question(rocketkv_bin, env, kv):
    r = run(rocketkv_bin, env, "ask", "--cache", kv, "What is the code?", "Which word is first?", "--json")
    assert r.returncode == 0, r.stderr
    rows = [json.loads(line) for line in r.stdout.splitlines()]
    assert [row["question"] for row in rows] == ["What is the code?", "Which word is first?"]
    keys = {
        "question",
        "answer",
        "cache",
        "n_question_tokens",
        "n_answer_tokens",
        "stop_reason",
        "prefill_s",
        "decode_s",
    }
    assert all(set(row) == keys for row in rows)
    assert all(0 < row["n_answer_tokens"] <= 6 or row["stop_reason"] != "length" for row in rows)


def test__ask__questions_file_from_stdin_matches_arguments(rocketkv_bin, env, kv):
    a = run(rocketkv_bin, env, "ask", "--cache", kv, "--questions-file", "-", "--json", stdin="Q one?\n\nQ two?\n")
    b = run(rocketkv_bin, env, "ask", "--cache", kv, "Q two?", "--json")
    assert a.returncode == 0 and b.returncode == 0, a.stderr + b.stderr
    rows = [json.loads(x) for x in a.stdout.splitlines()]
    assert len(rows) == 2 and rows[1]["answer"] == json.loads(b.stdout)["answer"]


def test__inspect_json__describes_the_cache(rocketkv_bin, env, kv):
    r = run(rocketkv_bin, env, "inspect", kv, "--json")
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout)
    assert info["format"] == "rocketkv.kv_cache" and int(info["n_context_tokens"]) > 600
    assert max(info["kept_tokens_per_layer"]) == info["budgets"]["prompt_budget"] < int(info["n_context_tokens"])
    assert info["kv_bytes"] < info["full_kv_bytes"]


def test__ingest__existing_target_refused_without_force(rocketkv_bin, env, kv, doc, tiny_model_dir):
    before = kv.read_bytes()
    r = run(rocketkv_bin, env, "ingest", doc, "-o", kv, "--model", tiny_model_dir)
    assert "--force" in assert_one_line_error(r)
    assert kv.read_bytes() == before


def test__ingest_from_stdin_and_ask_without_cache(rocketkv_bin, env, doc, tiny_model_dir, tmp_path):
    out = tmp_path / "stdin.kv"
    r = run(rocketkv_bin, env, "ingest", "-", "-o", out, "--model", tiny_model_dir, "--json", stdin=doc.read_text())
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["cache"] == str(out)
    r = run(rocketkv_bin, env, "ask", doc, "Which word?", "--model", tiny_model_dir, "--max-new-tokens", "4", "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["question"] == "Which word?"


def test__summarize_from_cache_prints_text(rocketkv_bin, env, kv):
    r = run(rocketkv_bin, env, "summarize", "--cache", kv, "--max-new-tokens", "5", "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["n_answer_tokens"] <= 5


def test__usage_error_exit_2(rocketkv_bin, env):
    r = run(rocketkv_bin, env, "ingest", "--no-such-option")
    assert r.returncode == 2


def test__cache_for_another_model_refused(rocketkv_bin, env, kv, tmp_path):
    import torch
    from conftest import byte_tokenizer, tiny_model

    other = tmp_path / "other"
    tiny_model("llama", torch.float32, seed=5).save_pretrained(other)
    byte_tokenizer().save_pretrained(other)
    r = run(rocketkv_bin, env, "ask", "--cache", kv, "q?", "--model", other)
    line = assert_one_line_error(r)
    assert "another model" in line and "rocketkv ingest" in line


def test__closed_stdout__quiet_exit_141(rocketkv_bin, env, kv):
    """`rocketkv ask ... | head -c 1`: no traceback, no 'Exception ignored' noise."""
    proc = subprocess.Popen([rocketkv_bin, "ask", "--cache", str(kv), "--questions-file", "-", "--json",
                             "--max-new-tokens", "2"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env=env)  # fmt: skip
    proc.stdin.write(b"Which word?\n" * 200)
    proc.stdin.close()
    proc.stdout.read(1)
    proc.stdout.close()
    stderr = proc.stderr.read().decode()
    assert proc.wait(timeout=300) == 141, stderr
    assert "Traceback" not in stderr and "Exception ignored" not in stderr
