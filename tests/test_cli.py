"""The installed `rocketkv` CLI, run in subprocesses against a saved tiny model (docs/usage.md: Command line)."""

import json
import os
import re
import shlex
import signal
import stat
import subprocess
import sys

import pytest
from conftest import run_in_terminal, strip_ansi, text_of_bytes


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


def test__inspect__shows_the_storage_sinks_and_key_basis(rocketkv_bin, env, doc, tiny_model_dir, tmp_path):
    out = tmp_path / "rope.kv"
    r = run(rocketkv_bin, env, "ingest", doc, "-o", out, "--model", tiny_model_dir, "--budget", "64",
            "--kv-dtype", "int4+rope")  # fmt: skip
    assert r.returncode == 0, r.stderr
    shown = run(rocketkv_bin, env, "inspect", out)
    assert "int4 keys/values (each head's first 4 tokens in float16; keys quantized before RoPE)" in shown.stdout
    assert "rocketkv.kv_cache v4 (" in shown.stdout


def test__allocated_key_bits__ingest_inspect_and_ask(rocketkv_bin, env, doc, tiny_model_dir, tmp_path):
    out = tmp_path / "alloc.kv"
    r = run(rocketkv_bin, env, "ingest", doc, "-o", out, "--model", tiny_model_dir, "--budget", "64",
            "--kv-dtype", "int4+alloc", "--max-new-tokens", "6")  # fmt: skip
    assert r.returncode == 0, r.stderr
    shown = run(rocketkv_bin, env, "inspect", out)
    assert "key bits allocated per channel, 4 on average" in shown.stdout
    assert "rocketkv.kv_cache v5 (" in shown.stdout
    asked = run(rocketkv_bin, env, "ask", "--cache", out, "What is the code?", "--json")
    assert asked.returncode == 0 and json.loads(asked.stdout)["n_answer_tokens"] >= 1, asked.stderr


def test__unknown_storage__refused_before_the_model_loads(rocketkv_bin, env, doc, tmp_path):
    r = run(rocketkv_bin, env, "ingest", doc, "-o", tmp_path / "x.kv", "--kv-dtype", "int4+fast",
            "--model", str(tmp_path / "no-such-model"))  # fmt: skip
    assert r.returncode == 2 and "unknown storage option 'fast'" in r.stderr, r.stderr  # a usage error
    assert "no-such-model" not in r.stderr  # refused before the model (here: missing) is looked at


def test__text_file_as_cache__refused_before_torch_with_a_hint(rocketkv_bin, env, doc):
    """A document given as --cache is refused by its first bytes, before torch is imported (the
    refusal used to take the seconds of that import), with the command that asks it directly."""
    from rocketkv_cli.api import preflight
    from rocketkv_cli.store import format as store_format

    assert preflight.MAX_HEADER_BYTES == store_format.MAX_HEADER_BYTES
    probe = "import sys; from rocketkv_cli.entry import main\n"
    probe += "sys.argv = ['rocketkv', 'ask', '--cache', sys.argv[1], 'q?']\n"
    probe += "try:\n    main()\nexcept SystemExit as e:\n    print('torch' in sys.modules, e.code)\n"
    r = subprocess.run([sys.executable, "-c", probe, str(doc)], env=env, capture_output=True, text=True, timeout=120)
    assert r.stdout.split() == ["False", "1"], (r.stdout, r.stderr)
    assert f"{doc} is a text document, not a rocketkv cache" in r.stderr, r.stderr
    assert f"rocketkv ask {doc} QUESTION" in r.stderr, r.stderr
    named = doc.parent / "named-as-a-cache.kv"  # text in a file named as a cache: damaged, not a document to ask
    named.write_text(doc.read_text())
    r = subprocess.run([sys.executable, "-c", probe, str(named)], env=env, capture_output=True, text=True, timeout=120)
    assert r.stdout.split() == ["False", "1"], (r.stdout, r.stderr)
    assert f"{named} holds text, not a rocketkv cache: damaged, or not written by rocketkv" in r.stderr, r.stderr
    assert "rocketkv ask" not in r.stderr and "rocketkv ingest DOC -o FILE.kv --force" in r.stderr, r.stderr


@pytest.mark.parametrize(
    "command, hint",
    [("summarize", "give it without --cache: rocketkv summarize {doc}"),
     ("chat", "give it without --cache: rocketkv chat {doc}"),
     ("inspect", "build a cache from it: rocketkv ingest {doc}")],
)  # fmt: skip
def test__text_file_as_cache__the_hint_is_the_commands_own(rocketkv_bin, env, doc, command, hint):
    """`summarize --cache doc.txt` used to suggest `rocketkv ask doc.txt QUESTION`; each command
    names its own way with a document, in a pipe and in a terminal."""
    args = [command, *([str(doc)] if command == "inspect" else ["--cache", str(doc)])]
    want = f"{doc} is a text document, not a rocketkv cache — {hint.format(doc=doc)}"
    r = run(rocketkv_bin, env, *args, stdin="")
    assert r.returncode == 1 and [line for line in r.stderr.splitlines() if line.startswith("Error:")] == [
        f"Error: {want}"
    ], r.stderr
    code, shown = run_in_terminal([rocketkv_bin, *args], env)
    screen = " ".join(strip_ansi(shown).split())
    assert code == 1 and want in screen and "Traceback" not in screen, screen


@pytest.mark.parametrize(
    "content, text",
    [
        ("plain words, more words", True),
        ("\u00e9" * 20, True),  # the 9th byte cuts a two-byte character in half
        ("\ufeffa document with a BOM", True),
        ("\u4e2d\u6587\u6587\u6863", True),  # three-byte characters
        (b"\x00\x01\x02binary data", False),
        (b"\xff\xfe\x00\x00 not utf-8", False),
    ],
)
def test__text_file_as_cache__recognised_as_text_even_when_a_character_is_cut(tmp_path, content, text):
    from rocketkv_cli.api.preflight import check_cache_file
    from rocketkv_cli.errors import CacheFormatError

    path = tmp_path / "doc.txt"
    path.write_bytes(content if isinstance(content, bytes) else content.encode("utf-8"))
    with pytest.raises(CacheFormatError) as err:
        check_cache_file(path)
    assert ("is a text document" in str(err.value)) == text, str(err.value)


@pytest.mark.parametrize("command", ["ask", "chat"])
def test__budget_with_cache__says_the_file_keeps_its_own(rocketkv_bin, env, kv, command):
    args = [command, "--cache", kv, "--budget", "128"] + (["Which word?"] if command == "ask" else [])
    r = run(rocketkv_bin, env, *args, stdin="Which word?\n")
    assert r.returncode == 0, r.stderr
    assert f"--budget 128 applies to a DOC ingested here; {kv} keeps the budget it was built with" in r.stderr
    quiet = run(rocketkv_bin, env, command, "--cache", kv, *args[5:], stdin="Which word?\n")
    assert quiet.returncode == 0, quiet.stderr
    assert "keeps the budget" not in quiet.stderr
    bad = run(rocketkv_bin, env, *args[:4], "0", *args[5:], stdin="Which word?\n")  # no ingest takes it: no hint
    assert "--budget must be a positive integer, got 0" in assert_one_line_error(bad, code=2)
    assert "rocketkv ingest DOC --budget 0" not in bad.stderr


@pytest.mark.parametrize("command", ["ask", "chat"])
def test__doc_with_budget_zero__refused_not_replaced_by_the_default(rocketkv_bin, env, doc, tiny_model_dir, command):
    args = [command, doc, "--model", tiny_model_dir, "--budget", "0"] + (["Which word?"] if command == "ask" else [])
    r = run(rocketkv_bin, env, *args, stdin="Which word?\n")
    assert r.returncode == 2, r.stderr  # a usage error
    assert "invalid option: --budget must be a positive integer, got 0" in r.stderr, r.stderr


def test__ask__questions_file_from_stdin_matches_arguments(rocketkv_bin, env, kv):
    a = run(rocketkv_bin, env, "ask", "--cache", kv, "--questions-file", "-", "--json", stdin="Q one?\n\nQ two?\n")
    b = run(rocketkv_bin, env, "ask", "--cache", kv, "Q two?", "--json")
    assert a.returncode == 0 and b.returncode == 0, a.stderr + b.stderr
    rows = [json.loads(x) for x in a.stdout.splitlines()]
    assert len(rows) == 2 and rows[1]["answer"] == json.loads(b.stdout)["answer"]


def test__inspect__a_source_name_with_control_characters_stays_on_its_line(rocketkv_bin, env, doc, tiny_model_dir,
                                                                           tmp_path):  # fmt: skip
    """A file name may hold a newline or an escape sequence; `inspect` prints the name the cache
    recorded escaped, one line per field, nothing that drives the terminal."""
    odd = tmp_path / "two\nlines\x1b[31m.txt"
    odd.write_text(doc.read_text())
    out = tmp_path / "odd.kv"
    r = run(rocketkv_bin, env, "ingest", odd, "-o", out, "--model", tiny_model_dir, "--budget", "64")
    assert r.returncode == 0, r.stderr
    shown = run(rocketkv_bin, env, "inspect", out)
    (line,) = [x for x in shown.stdout.splitlines() if x.startswith("document")]
    assert "two\\nlines\\x1b[31m.txt" in line and "\x1b" not in shown.stdout, shown.stdout


def test__inspect_json__describes_the_cache(rocketkv_bin, env, kv):
    r = run(rocketkv_bin, env, "inspect", kv, "--json")
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout)
    assert info["format"] == "rocketkv.kv_cache" and int(info["n_context_tokens"]) > 600
    assert max(info["kept_tokens_per_layer"]) == info["budgets"]["prompt_budget"] < int(info["n_context_tokens"])
    assert info["kv_bytes"] < info["full_kv_bytes"]
    assert info["layer_budgets"] == "uniform"  # named as `ingest --json` names it (the config omits the default)


def test__inspect__imports_no_transformers(rocketkv_bin, env, kv):
    """`inspect` reads and checks the file with torch alone: transformers (seconds to import) and
    the model stay out of it."""
    r = subprocess.run([sys.executable, "-X", "importtime", "-m", "rocketkv_cli", "inspect", str(kv)],
                       capture_output=True, text=True, env=env, timeout=300)  # fmt: skip
    imported = {line.rsplit("|", 1)[-1].strip() for line in r.stderr.splitlines() if line.startswith("import time:")}
    assert r.returncode == 0 and "context tokens" in r.stdout, r.stderr[-2000:]
    assert "transformers" not in imported, sorted(m for m in imported if m.startswith("transformers"))[:5]


def test__ingest__existing_target_refused_without_force(rocketkv_bin, env, kv, doc, tiny_model_dir):
    before = kv.read_bytes()
    r = run(rocketkv_bin, env, "ingest", doc, "-o", kv, "--model", tiny_model_dir)
    assert "--force" in assert_one_line_error(r)
    assert kv.read_bytes() == before


def test__ingest__a_path_with_a_line_break__one_line_on_stderr(rocketkv_bin, env, doc, tiny_model_dir, tmp_path):
    out = tmp_path / "two\nlines.kv"
    r = run(rocketkv_bin, env, "ingest", doc, "-o", out, "--model", tiny_model_dir)
    assert r.returncode == 0 and r.stdout == f"{out}\n" and out.is_file(), r.stderr
    wrote = [line for line in r.stderr.splitlines() if "wrote" in line]
    assert wrote == [f"rocketkv: wrote {tmp_path}/two\\nlines.kv ({out.stat().st_size / 1e6:.1f} MB)"], r.stderr


def test__ingest_without_o__a_read_only_folder_is_not_written_even_as_root(rocketkv_bin, env, doc, tiny_model_dir,
                                                                          tmp_path):  # fmt: skip
    """`ingest DOC` writes DOC.kv beside DOC: root did so into a folder of mode r-xr-xr-x (the
    shared data folder); a folder without write bits is refused now, before the model loads."""
    shared = tmp_path / "shared"
    shared.mkdir()
    (shared / "doc.txt").write_text(doc.read_text())
    shared.chmod(0o555)
    try:
        r = run(rocketkv_bin, env, "ingest", shared / "doc.txt", "--model", tiny_model_dir)
        assert "is read-only (no write permission)" in assert_one_line_error(r) and "loaded" not in r.stderr
        assert sorted(p.name for p in shared.iterdir()) == ["doc.txt"]
    finally:
        shared.chmod(0o755)


@pytest.mark.parametrize("command", ["ask", "ingest", "summarize", "chat"])
def test__cache_given_as_the_document__says_use_cache(rocketkv_bin, env, kv, command, tmp_path):
    """A new user's slip: `ask X.kv QUESTION` without --cache names the fix, not an encoding; the
    fix is the command's own (`summarize --cache X.kv`, not `ask`)."""
    args = {"ask": [kv, "Who?"], "ingest": [kv, "-o", tmp_path / "again.kv"]}.get(command, [kv])
    r = run(rocketkv_bin, env, command, *args, stdin="Who?\n" if command == "chat" else None)
    errors = [line for line in r.stderr.splitlines() if line.startswith("Error:")]
    assert r.returncode == 1 and len(errors) == 1 and "Traceback" not in r.stderr, r.stderr
    fix = {"summarize": f"rocketkv summarize --cache {kv}", "chat": f"rocketkv chat --cache {kv}"}
    assert "is a rocketkv cache, not a document" in errors[0], errors
    assert errors[0].endswith(fix.get(command, f"rocketkv ask --cache {kv} QUESTION")), errors
    assert not (tmp_path / "again.kv").exists() and "rocketkv: loaded" not in r.stderr
    if command == "ask":  # a cache over 256 KB got the in-memory note (an ingest of the cache!) before the error
        big = tmp_path / "big.kv"
        big.write_bytes(kv.read_bytes() + b"\0" * 300_000)
        r = run(rocketkv_bin, env, "ask", big, "Who?")
        assert r.returncode == 1 and r.stderr.startswith("Error:") and len(r.stderr.splitlines()) == 1, r.stderr


def test__ingest_from_stdin_and_ask_without_cache(rocketkv_bin, env, doc, tiny_model_dir, tmp_path):
    out = tmp_path / "stdin.kv"
    r = run(rocketkv_bin, env, "ingest", "-", "-o", out, "--model", tiny_model_dir, "--json", stdin=doc.read_text())
    assert r.returncode == 0, r.stderr
    row = json.loads(r.stdout)
    assert row["cache"] == str(out) and row["layer_budgets"] == "uniform"
    inspected = json.loads(run(rocketkv_bin, env, "inspect", out, "--json").stdout)
    assert row["kept_tokens_per_layer"] == inspected["kept_tokens_per_layer"] and row["kept_tokens_per_layer"]
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


# -- issue 16: output formats, streaming, sampling, chat, citations, models, help --------------------------------


def ask_json(rocketkv_bin, env, kv, *args):
    r = run(rocketkv_bin, env, "ask", "--cache", kv, *args, "--json")
    assert r.returncode == 0, r.stderr
    return [json.loads(line) for line in r.stdout.splitlines()]


def parse_qa(text: str) -> list[tuple[str, str]]:
    """Q:/A: records: a line starting "Q: " starts one; continuation lines are indented by 3."""
    records, field = [], None
    for line in text.split("\n"):
        if line.startswith("Q: "):
            records.append(["", ""])
            field, records[-1][0] = 0, line[3:]
        elif line.startswith("A: ") and records:
            field, records[-1][1] = 1, line[3:]
        elif line.startswith("   ") and field is not None:
            records[-1][field] += "\n" + line[3:]
        else:
            assert line == "", f"a line that belongs to no record: {line!r}"
            field = None
    return [(q, a) for q, a in records]


QS = ["What is the code?", "Which word\ncomes first?", "Where is the river?"]


def test__several_questions__qa_and_lines_formats_say_which_answer_is_which(rocketkv_bin, env, kv):
    """Plain output of several answers is never ambiguous (issue 16): parsed back, the Q:/A:
    records and the one-answer-per-line format give exactly the --json answers, in order, even
    for a question with a line break and answers with any bytes."""
    rows = ask_json(rocketkv_bin, env, kv, *QS)
    qa = run(rocketkv_bin, env, "ask", "--cache", kv, *QS)  # a pipe, several questions: qa by default
    assert qa.returncode == 0, qa.stderr
    assert parse_qa(qa.stdout) == [(row["question"], row["answer"]) for row in rows]
    lines = run(rocketkv_bin, env, "ask", "--cache", kv, *QS, "--format", "lines")
    unescape = lambda s: re.sub(r"\\(.)", lambda m: {"n": "\n", "r": "\r", "\\": "\\"}[m.group(1)], s)
    assert [unescape(line) for line in lines.stdout.split("\n")[:-1]] == [row["answer"] for row in rows]
    one = run(rocketkv_bin, env, "ask", "--cache", kv, QS[0], "--stream")  # one question: the answer as it is
    assert one.stdout == rows[0]["answer"] + "\n"


@pytest.mark.parametrize(
    "args, says",
    [
        ([], "QUESTION..."),
        (["--cache", "KV"], "QUESTION..."),
        (["--cache", "KV", "a?", "b?", "--format", "text"], "--format"),
        (["--cache", "KV", "a?", "--stream", "--json"], "--stream"),
        (["--cache", "KV", "a?", "--cite", "--format", "lines"], "--cite"),
        (["--cache", "KV", "a?", "--format", "yaml"], "--format"),
        (["--cache", "KV", "--bogus", "a?"], "No such option: --bogus"),
        (
            ["--cache", "KV", "- apples\n- pears\nWhich fruits?"],
            "(text that starts with '-', such as a question, goes after --)",
        ),
        (["--cache", "KV", "-3 degrees?"], "No such option: -3 (text that starts with '-'"),
        (["--cache", "KV", "--bogus", "--", "- apples"], "--verbose); try"),  # after --: no hint
        (["--cache", "KV", "a?", "--max-new-tokens", "ten"], "'--max-new-tokens': 'ten' is not an integer"),
        (["--cache", "KV", "a?", "--temperature=warm"], "'--temperature' / '-t': 'warm' is not a number"),
        (["--cache", "KV", "KV", "a?"], "give one of them"),
        (["--cache", "KV", "a?", "--threads", "0"], "'--threads': must be at least 1, got '0'"),
        (["--cache", "KV", "a?", "--threads=-2"], "'--threads': must be at least 1, got '-2'"),
        (["--cache", "KV", "a?", "--segment", "1", "--segments", "2"], "--segment J (that one), not both"),
    ],
    ids=[
        "nothing",
        "cache-no-question",
        "text-several",
        "stream-json",
        "cite-lines",
        "unknown-format",
        "unknown-option",
        "a-list-as-question",
        "a-number-as-question",
        "unknown-option-text-after-dashes",
        "not-an-integer",
        "not-a-number",
        "document-and-cache",
        "below-the-least",
        "below-the-least-with-equals",
        "segment-and-segments",
    ],  # fmt: skip
)
def test__ask_usage_errors__exit_2_before_the_model_loads(rocketkv_bin, env, kv, args, says):
    r = run(rocketkv_bin, env, "ask", *[str(kv) if a == "KV" else a for a in args])
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert r.stderr.count("\n") == 1 and r.stderr.startswith("Error: ") and says in r.stderr, r.stderr  # one line
    assert r.stderr.rstrip().endswith("; try 'rocketkv ask --help'"), r.stderr
    assert r.stdout == "" and "loaded" not in r.stderr and "Traceback" not in r.stderr


def test__a_question_longer_than_a_file_name_is_answered(rocketkv_bin, env, kv):
    """With --cache every argument is a question; one over 255 bytes (no file can have that name)
    is asked, not refused with the OS's "File name too long"."""
    question = "Which words are repeated in this document, and how often? " * 6
    r = run(rocketkv_bin, env, "ask", "--cache", kv, question, "--max-new-tokens", "2", "--json")
    assert r.returncode == 0 and json.loads(r.stdout)["question"] == question, r.stderr[-500:]


def test__sampling__seeded_runs_repeat_greedy_stays_exact(rocketkv_bin, env, kv):
    greedy = [row["answer"] for row in ask_json(rocketkv_bin, env, kv, *QS[:2], "--max-new-tokens", "12")]
    a = ask_json(rocketkv_bin, env, kv, *QS[:2], "--max-new-tokens", "12", "-t", "1.5", "--seed", "7")
    b = ask_json(rocketkv_bin, env, kv, QS[1], "--max-new-tokens", "12", "-t", "1.5", "--seed", "7")
    c = ask_json(rocketkv_bin, env, kv, *QS[:2], "--max-new-tokens", "12", "-t", "1.5", "--seed", "8")
    nucleus = ask_json(rocketkv_bin, env, kv, *QS[:2], "--max-new-tokens", "12", "-t", "1.5", "--top-p", "1e-9")
    assert a[1]["answer"] == b[0]["answer"]  # the seed restarts per question: order does not matter
    assert [r["answer"] for r in a] != [r["answer"] for r in c]  # another seed, other answers
    assert [r["answer"] for r in a] != greedy and [r["answer"] for r in nucleus] == greedy  # top-p→0 is greedy
    assert a[0]["sampling"] == {"temperature": 1.5, "top_p": 1.0, "seed": 7} and "sampling" not in json.dumps(greedy)
    assert isinstance(nucleus[0]["sampling"]["seed"], int)  # no --seed: a random one, reported


def test__chat_from_a_pipe__loads_once_answers_each_line_as_ask_does(rocketkv_bin, env, kv):
    expected = ask_json(rocketkv_bin, env, kv, QS[0], QS[2])
    long_question = "word " * 5000  # more than the model's context: an error for this line only
    r = run(rocketkv_bin, env, "chat", "--cache", kv, "--json", stdin=f"{QS[0]}\n\n{long_question}\n{QS[2]}\n")
    assert r.returncode == 1, r.stderr  # one question failed
    rows = [json.loads(line) for line in r.stdout.splitlines()]
    drop = lambda row: {k: v for k, v in row.items() if k not in ("prefill_s", "decode_s")}
    assert [drop(row) for row in rows] == [drop(row) for row in expected]
    assert r.stderr.count("rocketkv: loaded") == 1
    assert [line for line in r.stderr.splitlines() if line.startswith("Error:")] == [
        line for line in r.stderr.splitlines() if "question is" in line and "tokens" in line
    ]


@pytest.mark.parametrize("end", ["\r", "\r\n"])
def test__chat_from_a_pipe__cr_line_ends_are_line_ends(rocketkv_bin, env, kv, end):
    """Questions piped with CR line ends (old Macs, some programs) were one question "Q1\rQ2"
    (the CR hid the first on a terminal) and only the last was answered; each is asked now, as
    `ask -` reads them. CRLF ends keep no CR in the question."""
    expected = ask_json(rocketkv_bin, env, kv, QS[0], QS[2])
    # U+2028 and a form feed inside a question are no line ends (a split on every line break of
    # str.splitlines made them two questions); the JSON records show each question as asked
    r = run(rocketkv_bin, env, "chat", "--cache", kv, "--json", stdin=f"{QS[0]}\u2028x\x0cy{end}")
    assert r.returncode == 0 and [json.loads(line)["question"] for line in r.stdout.split("\n") if line] == [
        f"{QS[0]}\u2028x\x0cy"], r.stdout  # fmt: skip
    r = run(rocketkv_bin, env, "chat", "--cache", kv, "--json", stdin=f"{QS[0]}{end}{QS[2]}{end}")
    assert r.returncode == 0, r.stderr
    drop = lambda row: {k: v for k, v in row.items() if k not in ("prefill_s", "decode_s")}  # noqa: E731
    assert [drop(json.loads(line)) for line in r.stdout.splitlines()] == [drop(row) for row in expected]


def test__chat_commands__help_and_quit_are_not_asked_as_questions(rocketkv_bin, env, kv):
    """`/help` printed help and `/quit` quit (they were answered as questions, as was `quit` at
    a prompt); an unknown `/word` says so (piped in: exit 1, a question fewer was answered); the
    lines after `/quit` are not read."""
    expected = ask_json(rocketkv_bin, env, kv, QS[0])
    r = run(rocketkv_bin, env, "chat", "--cache", kv, "--json", stdin=f"/help\n/nope\n{QS[0]}\n/quit\n{QS[2]}\n")
    assert r.returncode == 1, r.stderr
    drop = lambda row: {k: v for k, v in row.items() if k not in ("prefill_s", "decode_s")}
    assert [drop(json.loads(line)) for line in r.stdout.splitlines()] == [drop(row) for row in expected]
    assert "rocketkv: one question per line, each answered from the document on its own" in r.stderr, r.stderr
    assert "Ctrl-C" not in r.stderr and "Up brings back" not in r.stderr, r.stderr  # keys a pipe does not have
    assert "Error: unknown command /nope: /help lists what chat takes" in r.stderr, r.stderr


def test__ask_dash__reads_the_questions_from_stdin(rocketkv_bin, env, kv):
    """`echo QUESTION | rocketkv ask --cache F.kv -` asks the piped question (it asked "-")."""
    expected = run(rocketkv_bin, env, "ask", "--cache", kv, QS[0], QS[2])
    piped = run(rocketkv_bin, env, "ask", "--cache", kv, "-", stdin=f"{QS[0]}\n{QS[2]}\n")
    assert piped.returncode == 0 and piped.stdout == expected.stdout, piped.stderr
    none = run(rocketkv_bin, env, "ask", "--cache", kv)
    assert none.returncode == 2 and "or - to read them from stdin" in none.stderr, none.stderr


def test__cite__passages_map_to_the_document_characters_and_lines(rocketkv_bin, env, kv, doc):
    """Each citation's characters [start, end) of the source, whitespace normalised, are its
    text, and its line is the line of `start` in the source (checked on the document itself)."""
    (row,) = ask_json(rocketkv_bin, env, kv, "What is the secret code?", "--cite", "--passages", "2")
    text = doc.read_text()
    assert len(row["citations"]) == 2
    for c in row["citations"]:
        assert " ".join(text[c["start"] : c["end"]].split()) == c["text"] != ""
        assert text[c["start"] : c["end"]] == text[c["start"] : c["end"]].strip(), c  # no space or line break around
        assert c["line"] == text[: c["start"]].count("\n") + 1 and c["end_line"] >= c["line"]
        assert 0 < c["weight"] <= 1
    shown = run(rocketkv_bin, env, "ask", "--cache", kv, "What is the secret code?", "--cite", "--passages", "2")
    sources = shown.stdout.split("Sources:\n")[1].splitlines()
    assert [s.split(" (")[0] for s in sources] == [
        f"  [{i}] line {c['line']}, characters {c['start']}-{c['end']}" for i, c in enumerate(row["citations"], 1)
    ]


def test__a_citation_share_that_rounds_to_nothing_reads_below_one_percent():
    from rocketkv_cli.cli.answers import share

    assert [share(w) for w in (0.0036, 0.004, 0.005, 0.0051, 0.0198, 0.5, 1.0)] == [
        "<1%",
        "<1%",
        "<1%",
        "1%",
        "2%",
        "50%",
        "100%",
    ]


def test__ask_focus__answers_from_the_best_passage_in_a_pipe_and_a_terminal(rocketkv_bin, env, kv, doc):
    # the document is one 600-character line of filler words, then "The secret code is 4242.": the
    # question shares "the", "secret", "code" and "is" with line 2 and no word with line 1
    q = "What is the secret code?"
    r = run(rocketkv_bin, env, "ask", "--cache", kv, "--focus", "1", "--cite", "--passages", "5", "--json", q)
    assert r.returncode == 0, r.stderr
    assert "--passages does not apply with --focus: --cite lists the passages re-read (up to 1)" in r.stderr
    (row,) = [json.loads(line) for line in r.stdout.splitlines()]
    (c,) = row["citations"]
    assert (c["line"], c["end_line"], c["weight"], c["text"]) == (2, 2, 1.0, "The secret code is 4242.")
    assert doc.read_text()[c["start"] : c["end"]] == c["text"]
    assert "focus: answered from lines 2" in r.stderr
    code, shown = run_in_terminal([rocketkv_bin, "ask", "--cache", str(kv), "--focus", "1", "--cite", q], env)
    screen = strip_ansi(shown)
    assert code == 0, screen[-2000:]
    assert f"[1] line 2, characters {c['start']}-{c['end']} (100%)" in screen and "Traceback" not in screen
    # the stderr line naming the passages comes before the streamed answer, never after it on its line
    assert not [line for line in screen.splitlines() if line.find("rocketkv: focus:") > 0], screen[-2000:]
    bad = run(rocketkv_bin, env, "ask", "--cache", kv, "--focus", "1", "--dense", "--seed", "3", q)
    assert bad.returncode == 2 and "drop --dense, --seed" in bad.stderr and "Traceback" not in bad.stderr
    # `chat --focus`: each line answered as `ask --focus` answers it, with the same stderr line
    chat = run(rocketkv_bin, env, "chat", "--cache", kv, "--focus", "1", "--cite", "--json", stdin=f"{q}\n{q}\n")
    drop = lambda row: {k: v for k, v in row.items() if k not in ("prefill_s", "decode_s")}  # noqa: E731
    assert [drop(json.loads(line)) for line in chat.stdout.splitlines()] == [drop(row)] * 2, chat.stderr
    assert chat.stderr.count("focus: answered from lines 2") == 2 and chat.returncode == 0
    bad = run(rocketkv_bin, env, "chat", "--cache", kv, "--focus", "1", "--temperature", "0.5", stdin=f"{q}\n")
    assert bad.returncode == 2 and "drop --temperature" in bad.stderr and "Traceback" not in bad.stderr
    zero = run(rocketkv_bin, env, "ask", "--cache", kv, "--focus", "0", q)
    assert zero.returncode == 2 and "--focus" in zero.stderr


def test__cite__refused_for_a_file_without_token_offsets(rocketkv_bin, env):
    from pathlib import Path

    old = Path(__file__).parent / "data" / "v1-llama.kv"  # written by rocketkv 0.1.0, before token offsets
    r = run(rocketkv_bin, env, "ask", "--cache", old, "q?", "--cite")  # refused before any model loads
    assert "token offsets" in assert_one_line_error(r) and "loaded" not in r.stderr


def test__models__lists_and_removes_what_is_stored(rocketkv_bin, env, tmp_path):
    home = tmp_path / "home"
    (home / "models" / "gemma-3-270m-q4_k_m-0123").mkdir(parents=True)
    (home / "models" / "gemma-3-270m-q4_k_m-0123" / "model.safetensors").write_bytes(b"x" * 3000)
    (home / "downloads").mkdir()
    (home / "downloads" / "gemma-3-270m-q4_k_m.gguf").write_bytes(b"y" * 1000)
    (home / "downloads" / "mine.gguf").write_bytes(b"z" * 10)
    (home / "prepared").mkdir()
    (home / "prepared" / "0a1b.safetensors").write_bytes(b"h" * 20)  # a head-int4 prepared head
    env = {**env, "ROCKETKV_HOME": str(home)}
    r = run(rocketkv_bin, env, "models", "--json")
    assert r.returncode == 0, r.stderr
    rows = [json.loads(line) for line in r.stdout.splitlines()]
    assert [(x["name"], x["kind"], x["preset"], x["bytes"]) for x in rows] == [
        ("gemma-3-270m-q4_k_m-0123", "converted", "gemma-3-270m", 3000),
        ("gemma-3-270m-q4_k_m.gguf", "gguf", "gemma-3-270m", 1000),
        ("mine.gguf", "gguf", None, 10),
        ("0a1b.safetensors", "prepared", None, 20),
    ]
    r = run(rocketkv_bin, env, "models", "--remove", "0a1b.safetensors")
    assert r.returncode == 0 and not (home / "prepared" / "0a1b.safetensors").exists(), r.stderr
    assert "unknown" in assert_one_line_error(run(rocketkv_bin, env, "models", "--remove", "unknown"))
    r = run(rocketkv_bin, env, "models", "--remove", "gemma-3-270m")
    assert r.returncode == 0, r.stderr
    assert sorted(p.name for p in home.rglob("*") if p.is_file()) == ["mine.gguf"]
    assert "4.0 KB" in r.stderr  # freed
    elsewhere = tmp_path / "elsewhere"  # a converted model kept on another disk, linked in
    elsewhere.mkdir()
    (elsewhere / "model.safetensors").write_bytes(b"x" * 10)
    (home / "models" / "linked").symlink_to(elsewhere)
    r = run(rocketkv_bin, env, "models", "--remove", "linked")  # said "Cannot call rmtree on a symbolic link"
    assert r.returncode == 0 and not (home / "models" / "linked").is_symlink(), r.stderr
    assert (elsewhere / "model.safetensors").read_bytes() == b"x" * 10 and not list((home / "models").iterdir())
    (home / "models" / "broken").symlink_to(tmp_path / "gone")  # its target removed: listing it failed, and removing
    r = run(rocketkv_bin, env, "models", "--json")
    assert r.returncode == 0, r.stderr
    assert [(x["name"], x["bytes"]) for x in map(json.loads, r.stdout.splitlines())][0] == ("broken", 0), r.stdout
    r = run(rocketkv_bin, env, "models", "--remove", "broken")
    assert r.returncode == 0 and not (home / "models" / "broken").is_symlink(), r.stderr


COMMAND_NAMES = ["ingest", "ask", "chat", "summarize", "inspect", "models", "bench", "eval"]


@pytest.mark.parametrize("command", [None, *COMMAND_NAMES])
def test__help_reads_well_at_80_columns(rocketkv_bin, env, command):
    """No line over 80 columns, no cut option name, no type placeholder (`<bool>`, `<int>`),
    arguments named in the usage line, nothing outside the repository cited."""
    r = run(rocketkv_bin, {**env, "COLUMNS": "80"}, *([command] if command else []), "--help")
    assert r.returncode == 0, r.stderr
    assert all(len(line) <= 80 for line in r.stdout.splitlines()), max(r.stdout.splitlines(), key=len)
    assert "…" not in r.stdout and not re.search(r"<[a-z][a-z \[\]]*>", r.stdout), r.stdout
    assert "[args]" not in r.stdout and "SPEC" not in r.stdout and "issue" not in r.stdout.lower()
    usage = r.stdout.splitlines()[0]
    expected = {"ask": "[DOC] QUESTION...", "chat": "[DOC]", "summarize": "[DOC]", "ingest": "DOCUMENT",
                "inspect": "CACHE", None: "COMMAND"}  # fmt: skip
    assert usage.startswith(f"Usage: rocketkv {command + ' ' if command else ''}[OPTIONS]")
    assert expected.get(command, "") in usage


@pytest.mark.parametrize("command", ["ingest", "ask", "chat", "summarize", "bench", "eval", "serve"])
def test__every_command_that_runs_the_model_takes_threads(rocketkv_bin, env, command):
    """`--threads N` on each command that computes (not only ask): a bad value is a usage error,
    exit 2, one line naming the option, before any model loads."""
    r = run(rocketkv_bin, env, command, "--threads", "0", *(["x.txt"] if command == "ingest" else []))
    assert r.returncode == 2, r.stderr
    assert "Invalid value for '--threads'" in r.stderr and "No such option" not in r.stderr, r.stderr
    assert "Traceback" not in r.stderr, r.stderr


@pytest.mark.parametrize(
    "args, name",
    [
        (["ask", "--cache", "", "q?"], "'--cache'"),
        (["ask", "", "q?"], "[DOC]"),
        (["ask", "--cache", "x.kv", "--questions-file", "", "q?"], "'--questions-file'"),
        (["ingest", ""], "'DOCUMENT'"),
        (["ingest", "x.txt", "-o", ""], "'--output'"),
        (["summarize", ""], "'[DOC]'"),
        (["chat", ""], "'[DOC]'"),
        (["inspect", ""], "'CACHE'"),
        (["batch", ""], "'MANIFEST'"),
        (["batch", "m.jsonl", "--cache-dir", ""], "'--cache-dir'"),
        (["serve", "--allow-dir", ""], "'--allow-dir'"),
        (["serve", "--socket", ""], "'--socket'"),
        (["eval", "--json", ""], "'--json'"),
        (["bench", "--source", ""], "'--source'"),
    ],
)
def test__an_empty_path__a_usage_error_not_the_current_folder(rocketkv_bin, env, tmp_path, args, name):
    """An empty path (`--allow-dir "$UNSET"`) is refused by name, exit 2: it used to become `.`, the
    current folder (`inspect ''`: ". is a directory"; `serve --allow-dir ''` served the folder)."""
    r = run(rocketkv_bin, env, *args, cwd=tmp_path)
    error = assert_one_line_error(r, code=2)
    assert f"Invalid value for {name}" in error and "is empty" in error, error


@pytest.mark.parametrize("command", ["ingest", "ask", "serve"])
def test__threads_beyond_the_machines_cpus__a_usage_error(rocketkv_bin, env, command, tmp_path):
    """More threads than the machine has CPUs (99999 used to fail starting them: exit 1 with
    "can't start new thread") is a usage error naming the limit, from the option and the variable."""
    cpus = os.cpu_count() or 1
    extra = ["x.txt"] if command == "ingest" else ["--cache", str(tmp_path / "x.kv"), "q?"] if command == "ask" else []
    for args, e in ((["--threads", "99999"], env), ([], {**env, "ROCKETKV_THREADS": str(cpus + 1)})):
        r = run(rocketkv_bin, e, command, *args, *extra)
        errors = [line for line in r.stderr.splitlines() if line.startswith("Error:")]
        assert r.returncode == 2 and len(errors) == 1, r.stderr
        assert f"more than this machine's {cpus} CPUs" in errors[0] and "Traceback" not in r.stderr, r.stderr


def test__ingest_from_stdin_without_an_output__a_usage_error(rocketkv_bin, env):
    r = run(rocketkv_bin, env, "ingest", "-", stdin="Some text to keep.\n")
    error = assert_one_line_error(r, code=2)
    assert "needs an output file" in error and "-o FILE.kv" in error, error


def test__an_empty_omp_num_threads_is_unset__no_openmp_warnings(rocketkv_bin, env, kv):
    """`OMP_NUM_THREADS= rocketkv ask …` (a shell's way to unset it for one command): chosen as if
    unset, and OpenMP, loaded with torch, does not print its "Invalid value" warning twice."""
    base = {k: v for k, v in env.items() if k not in ("ROCKETKV_THREADS", "OMP_NUM_THREADS")}
    r = run(rocketkv_bin, {**base, "OMP_NUM_THREADS": ""}, "ask", "--cache", kv, "--no-server", "-v", "Code?")
    assert r.returncode == 0, r.stderr
    assert "Invalid value" not in r.stderr and "libgomp" not in r.stderr, r.stderr
    assert "$OMP_NUM_THREADS" not in r.stderr, r.stderr  # the count was chosen, not read from it


def test__verbose_names_the_threads_chosen_when_the_model_loaded(rocketkv_bin, env, kv):
    """Without --threads the count is chosen when the model loads, from the cores this process may
    use and how busy other processes kept them; `-v` says which (and an explicit count says so)."""
    r = run(rocketkv_bin, {k: v for k, v in env.items() if k not in ("ROCKETKV_THREADS", "OMP_NUM_THREADS")},
            "ask", "--cache", kv, "--no-server", "-v", "What is the secret code?")  # fmt: skip
    assert r.returncode == 0, r.stderr
    line = next(x for x in r.stderr.splitlines() if "threads:" in x)
    if len(os.sched_getaffinity(0)) > 1:  # measured over the seconds of importing torch: known here
        chosen = r"threads: \d+ \(\d+ cores this process may use, [\d.]+ of \d+ busy with other processes\)"
        assert re.search(chosen, line), line
    r = run(rocketkv_bin, env, "ask", "--cache", kv, "--no-server", "-v", "--threads", "1", "What is the code?")
    assert r.returncode == 0 and "threads: 1 (--threads)" in r.stderr, r.stderr


def test__shell_completion__script_and_answers(rocketkv_bin, env):
    # Typer detects the shell from the parent process: run it from bash (`; true` keeps bash from
    # exec-ing the command, which would make pytest the parent), as a user's prompt would.
    r = subprocess.run(["bash", "-c", '"$0" --show-completion; true', rocketkv_bin], capture_output=True, text=True,
                       timeout=60, env=env)  # fmt: skip
    assert r.returncode == 0 and "_ROCKETKV_COMPLETE" in r.stdout and "complete -o" in r.stdout, r.stderr
    done = subprocess.run([rocketkv_bin], capture_output=True, text=True, timeout=60,
                          env={**env, "_ROCKETKV_COMPLETE": "complete_bash", "COMP_WORDS": "rocketkv ask --str",
                               "COMP_CWORD": "2"})  # fmt: skip
    assert done.stdout.split() == ["--stream"]


def test__ingest_adaptive_layer_budgets__inspect_and_ask(rocketkv_bin, env, doc, tiny_model_dir, tmp_path):
    """`--layer-budgets adaptive` splits the same total over the layers (inspect shows the range and
    the mean); `ask` answers from the file; an unknown value is a usage error before any model loads."""
    out = tmp_path / "adaptive.kv"
    r = run(rocketkv_bin, env, "ingest", doc, "-o", out, "--model", tiny_model_dir, "--budget", "64",
            "--max-new-tokens", "6", "--layer-budgets", "adaptive", "--json")  # fmt: skip
    assert r.returncode == 0, r.stderr
    row = json.loads(r.stdout)
    info = json.loads(run(rocketkv_bin, env, "inspect", out, "--json").stdout)
    full = [k for k, w in zip(info["kept_tokens_per_layer"], info["layer_windows"]) if not w]
    assert info["config"]["layer_budgets"] == info["layer_budgets"] == row["layer_budgets"] == "adaptive"
    assert row["kept_tokens_per_layer"] == info["kept_tokens_per_layer"]
    assert sum(full) == len(full) * info["budgets"]["prompt_budget"] and len(set(full)) > 1, full
    text = run(rocketkv_bin, env, "inspect", out).stdout
    assert f"{min(full)}-{max(full)} (mean {info['budgets']['prompt_budget']}; adaptive layer budgets)" in text, text
    a = run(rocketkv_bin, env, "ask", "--cache", out, "What is the secret code?", "--json")
    assert a.returncode == 0, a.stderr
    assert json.loads(a.stdout)["n_answer_tokens"] >= 1
    bad = run(rocketkv_bin, env, "ingest", doc, "-o", tmp_path / "bad.kv", "--model", tmp_path / "no-model",
              "--layer-budgets", "per-head")  # fmt: skip
    assert "--layer-budgets must be uniform or adaptive, got 'per-head'" in assert_one_line_error(bad, code=2)
    assert not (tmp_path / "bad.kv").exists()


def test__ingest_store_budget_and_reconstruct__inspect_and_ask(rocketkv_bin, env, doc, tiny_model_dir, tmp_path):
    """`--store-budget` keeps more tokens than the working set (inspect says each question
    re-selects), `--observation reconstruct` builds a cache, and `ask` answers from both."""
    out = tmp_path / "two.kv"
    r = run(rocketkv_bin, env, "ingest", doc, "-o", out, "--model", tiny_model_dir, "--budget", "64",
            "--max-new-tokens", "6", "--store-budget", "128", "--observation", "reconstruct")  # fmt: skip
    assert r.returncode == 0, r.stderr
    info = json.loads(run(rocketkv_bin, env, "inspect", out, "--json").stdout)
    assert info["config"]["store_budget"] == 128 and info["config"]["observation"] == "reconstruct"
    assert info["budgets"]["prompt_budget"] < max(info["kept_tokens_per_layer"]) < int(info["n_context_tokens"])
    text = run(rocketkv_bin, env, "inspect", out).stdout
    assert f"re-selects {info['budgets']['prompt_budget']:,} of the kept tokens" in text, text
    a = run(rocketkv_bin, env, "ask", "--cache", out, "What is the secret code?", "--json")
    assert a.returncode == 0, a.stderr
    assert json.loads(a.stdout)["n_answer_tokens"] >= 1
    bad = run(rocketkv_bin, env, "ingest", doc, "-o", tmp_path / "bad.kv", "--model", tiny_model_dir, "--budget",
              "64", "--store-budget", "32")  # fmt: skip
    assert "--store-budget must be at least the token budget" in assert_one_line_error(bad, code=2)
    assert not (tmp_path / "bad.kv").exists()


def test__ingest_store_budget_all__keeps_every_token_and_each_question_reselects(rocketkv_bin, env, doc,
                                                                                 tiny_model_dir, tmp_path):  # fmt: skip
    """`--store-budget all` stores every token of the document (no question-agnostic pruning),
    inspect says each question re-selects, ask answers; a store
    budget that is neither a count nor 'all' is a one-line usage error."""
    out = tmp_path / "all.kv"
    r = run(rocketkv_bin, env, "ingest", doc, "-o", out, "--model", tiny_model_dir, "--budget", "64",
            "--max-new-tokens", "6", "--store-budget", "all", "--observation", "reconstruct")  # fmt: skip
    assert r.returncode == 0, r.stderr
    info = json.loads(run(rocketkv_bin, env, "inspect", out, "--json").stdout)
    assert info["config"]["store_budget"] == "all"
    assert set(info["kept_tokens_per_layer"]) == {int(info["n_context_tokens"])}
    assert info["budgets"]["prompt_budget"] < int(info["n_context_tokens"])
    text = run(rocketkv_bin, env, "inspect", out).stdout
    assert f"re-selects {info['budgets']['prompt_budget']:,} of the kept tokens" in text, text
    a = run(rocketkv_bin, env, "ask", "--cache", out, "What is the secret code?", "--json")
    assert a.returncode == 0 and json.loads(a.stdout)["n_answer_tokens"] >= 1, a.stderr
    bad = run(rocketkv_bin, env, "ingest", doc, "-o", tmp_path / "bad.kv", "--model", tiny_model_dir,
              "--store-budget", "half")  # fmt: skip
    assert "--store-budget must be a token count or 'all', got 'half'" in assert_one_line_error(bad, code=2)
    assert not (tmp_path / "bad.kv").exists()


def test__option_names__fields_become_the_options_typed_and_words_stay_words():
    from rocketkv_cli.cli.common import option_names
    from rocketkv_cli.core.config import PrefillConfig

    with pytest.raises(ValueError) as err:
        PrefillConfig(token_budget=2, max_new_tokens=600)
    shown = option_names(str(err.value))
    assert shown.startswith("--budget 2 is below the observation window (--window-size 32)"), shown
    assert "token_budget" not in shown and "window_size" not in shown


def test__option_names__shown_once_and_only_for_fields():
    """Config field names become the options users typed, once: a message already rewritten (or
    naming `--topk` itself) is left as it is, and words inside other names are not touched."""
    from rocketkv_cli.cli.common import option_names

    once = option_names("invalid option: page_size must not exceed topk (32), got 300")
    assert once == "invalid option: --page-size must not exceed --topk (32), got 300"
    assert option_names(once) == once
    assert option_names("token_budget_x and my_topk") == "token_budget_x and my_topk"


def test__weights_int8__recorded_in_the_cache_and_used_by_ask(rocketkv_bin, env, doc, tiny_model_dir, tmp_path):
    """`ingest --weights int8` records the weights that prefilled the cache (`inspect` shows
    them); `ask` then loads the same format without being told (integer weights change what
    stage 1 kept), and `--weights float` overrides it."""
    from rocketkv_cli.api.rocketkv import read_cache

    out = tmp_path / "int8.kv"
    r = run(rocketkv_bin, env, "ingest", doc, "-o", out, "--model", tiny_model_dir, "--budget", "64",
            "--max-new-tokens", "6", "--weights", "int8")  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert read_cache(out).info.weights == "int8"
    r = run(rocketkv_bin, env, "inspect", out)
    assert re.search(r"model dtype\s+float32, int8 weights", r.stdout), r.stdout
    r = run(rocketkv_bin, env, "ask", "--cache", out, "What is the code?", "--max-new-tokens", "4")
    assert r.returncode == 0 and r.stdout.strip(), r.stderr
    assert "(float32, int8 weights)" in r.stderr, r.stderr
    r = run(rocketkv_bin, env, "ask", "--cache", out, "What is the code?", "--max-new-tokens", "4",
            "--weights", "float")  # fmt: skip
    assert r.returncode == 0 and "int8 weights" not in r.stderr, r.stderr


def test__unknown_weights__usage_error_before_the_model_loads(rocketkv_bin, env, doc, tmp_path):
    r = run(rocketkv_bin, env, "ingest", doc, "-o", tmp_path / "w.kv", "--weights", "int3",
            "--model", str(tmp_path / "no-such-model"))  # fmt: skip
    assert r.returncode == 2, r.stderr
    assert "'int3' is not one of float, head-bf16, bf16, int8, int4" in r.stderr, r.stderr
    assert "no-such-model" not in r.stderr, r.stderr
    assert not (tmp_path / "w.kv").exists()


@pytest.mark.parametrize(
    "args, says",
    [
        (["ingest", "DOC", "--encoding", "klingon"], "unknown text encoding 'klingon'"),
        (["ingest", "DOC", "--errors", "shrug"], "unknown --errors handler 'shrug'"),
        (["ask", "-", "--questions-file", "-"], "cannot both come from stdin"),
        (["chat", "-"], "DOC cannot be -"),
        (["ask", "DOC", "q?", "--dense", "--hsa"], "--dense and --hsa contradict each other"),
        (["chat", "DOC", "--dense", "--hsa"], "--dense and --hsa contradict each other"),
        (["ingest", "DOC", "--dtype", "int8"], "'int8' is not one of auto, float32, bfloat16, float16"),
        (["ingest", "DOC", "--device", "tpu"], "'tpu' is not cpu, cuda, cuda:N or auto"),
        (["ask", "DOC", "q?", "--temperature", "inf"], "inf is not a finite number ≥ 0"),
        (["ask", "DOC", "q?", "--temperature", "nan"], "nan is not a finite number ≥ 0"),
        (["ask", "DOC", "q?", "--top-p", "0"], "0.0 is not in (0, 1]"),
        (["ingest", "DOC", "-o", "-"], "-o -: a cache is a file, not a stream to stdout"),
        (["ask", "--cache", "-", "q?"], "a cache cannot come from stdin (-)"),
        (["ask", "DOC", "q?", "--seed", str(2**70)], "Invalid value for '--seed'"),
        (["ingest", "DOC", "--errors", "surrogateescape"], "unknown --errors handler 'surrogateescape'"),
    ],
    ids=[
        "encoding",
        "errors",
        "two-stdins",
        "chat-stdin-doc",
        "ask-dense-hsa",
        "chat-dense-hsa",
        "dtype",
        "device",
        "temperature-inf",
        "temperature-nan",
        "top-p-0",
        "output-stdout",
        "cache-stdin",
        "seed-beyond-int64",
        "errors-python-only",
    ],
)
def test__option_values_no_input_could_satisfy__exit_2_before_the_model_loads(rocketkv_bin, env, doc, tmp_path,
                                                                              args, says):  # fmt: skip
    argv = [str(doc) if a == "DOC" else a for a in args] + ["--model", str(tmp_path / "no-such-model")]
    r = run(rocketkv_bin, env, *argv, stdin="")
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert says in assert_one_line_error(r, code=2) and "no-such-model" not in r.stderr


@pytest.mark.parametrize(
    "args, says, code",
    [
        (["--page-size", "999"], "invalid option: --page-size must not exceed --topk", 1),
        (["--topk", "8", "--page-size", "16"], "invalid option: --page-size must not exceed --topk (8), got 16", 2),
    ],
    ids=["page-over-the-files-topk", "page-over-the-given-topk"],
)
def test__stage2_override_the_cache_cannot_take__refused_before_the_model_loads(rocketkv_bin, env, kv, tmp_path,
                                                                                args, says, code):  # fmt: skip
    """A page over the file's top-k depends on the file (exit 1); over a top-k given with it, it is
    a usage error whatever the file (exit 2, as ingest refuses the same pair)."""
    # --model names nothing: the refusal must come from the file's budgets, before any model load
    r = run(rocketkv_bin, env, "ask", "--cache", kv, "q?", *args, "--model", tmp_path / "no-such-model")
    assert says in assert_one_line_error(r, code=code) and "no-such-model" not in r.stderr


@pytest.mark.parametrize(
    "args, note",
    [
        (["--topk", "8"], "note: --topk tunes stage-2 HSA, which no layer uses here: no layer stores more than 4,096"),
        (
            ["--page-size", "4", "--n-score-dims", "8", "--dense"],
            "note: --page-size/--n-score-dims tune stage-2 HSA, which --dense turns off: they have no effect",
        ),
        (["--topk", "8", "--hsa"], None),
        (
            ["--topk", "1000", "--hsa"],
            "note: --topk tunes stage-2 HSA, which no layer uses here: the top-k covers every",
        ),
        ([], None),
    ],
    ids=["below-the-crossover", "dense", "hsa", "topk-covers-all", "no-override"],
)
def test__stage2_override_that_changes_nothing__says_so(rocketkv_bin, env, kv, args, note):
    """`--topk`/`--page-size`/`--n-score-dims` tune HSA: where no layer is attended with HSA (the
    CPU's crossover is above what each layer stores, or --dense), the answer is the same without
    them, and a note on stderr says so instead of letting the user believe they were used; with
    --hsa (HSA over the 64 stored tokens) they are used and nothing is said."""
    r = run(rocketkv_bin, env, "ask", "--cache", kv, "What is the code?", "--no-server", "--device", "cpu", *args)
    assert r.returncode == 0, r.stderr  # (the CPU's crossover: a GPU's is 0)
    notes = [line.removeprefix("rocketkv: ") for line in r.stderr.splitlines() if "stage-2" in line]
    if note is None:
        assert notes == [], r.stderr
    else:
        assert len(notes) == 1 and notes[0].startswith(note), r.stderr
        assert notes[0].endswith("(add --hsa to use HSA)") == ("crossover" in note or "4,096" in note), notes


def test__questions_on_stdin_that_are_not_utf8__refused_like_a_questions_file(rocketkv_bin, env, kv, tmp_path):
    """`--questions-file -` decodes stdin strictly, as `--questions-file PATH` reads a file: bytes
    that are not UTF-8 are an error (exit 1), not questions made of replacement characters."""
    junk = bytes([0xF8, 0x88, 0x80, 0x10, 0xFF, 0x0A]) * 3
    (tmp_path / "junk.bin").write_bytes(junk)
    r = subprocess.run([rocketkv_bin, "ask", "--cache", str(kv), "--questions-file", "-"], input=junk,
                       capture_output=True, env=env, timeout=300)  # fmt: skip
    res = subprocess.CompletedProcess(r.args, r.returncode, r.stdout.decode(), r.stderr.decode())
    assert "questions from stdin is not UTF-8 text (byte 0xf8 at offset 0)" in assert_one_line_error(res)
    by_path = run(rocketkv_bin, env, "ask", "--cache", kv, "--questions-file", tmp_path / "junk.bin")
    assert f"questions file {tmp_path / 'junk.bin'} is not UTF-8 text" in assert_one_line_error(by_path)


def test__questions_file__utf16_binary_and_paths__one_line_each_cr_line_ends_split(rocketkv_bin, env, kv, tmp_path):
    """A UTF-16 questions file (or one whose NULs show it, or any binary file) was answered as
    questions of NUL characters, exit 0; a missing file or a folder said Python's errno text; a
    file of CR line ends (old Macs) was one question."""
    text = "Who?\nWhere?\n"
    cases = [(text.encode("utf-16"), "is UTF-16 text — save it as UTF-8: iconv -f UTF-16 -t UTF-8 {q} > {q}.utf8.txt"),
             (text.encode("utf-32"), "is UTF-32 text — save it as UTF-8: iconv -f UTF-32 -t UTF-8"),
             (text.encode("utf-16-le"), "holds NUL bytes: binary data or UTF-16, not UTF-8 text"),
             (b"\xef\xbb\xbfWhat?\n\xff", "is not UTF-8 text (byte 0xff at offset 9)")]  # fmt: skip
    for i, (data, says) in enumerate(cases):
        q = tmp_path / f"q{i}.txt"  # the hint's iconv writes beside it: never `> q.txt` over the file it reads
        q.write_bytes(data)
        r = run(rocketkv_bin, env, "ask", "--cache", kv, "--questions-file", q)
        assert says.format(q=q) in assert_one_line_error(r) and "loaded" not in r.stderr, r.stderr
    for path, says in ((tmp_path / "nope.txt", "not found — check the path"), (tmp_path, "is a directory")):
        r = run(rocketkv_bin, env, "ask", "--cache", kv, "--questions-file", path)
        assert says in assert_one_line_error(r) and "Errno" not in r.stderr, r.stderr
    from rocketkv_cli.engine.inputs import check_questions
    from rocketkv_cli.errors import InputError

    for question, says in (("Who?\x00", "holds a NUL character"), ("\x01\u200b\x02", "question 2 of 2 has no visible")):
        with pytest.raises(InputError, match=says):  # chat's lines, the API's and the server's questions
            check_questions(["Where?", question])
    newer = [
        "\U0001fae8",
        "\U000f0001",
        "a\tb",
        "\u05d0\u200f?",
        "\U0001f469\u200d\U0001f4bb?",
    ]  # Unicode 15, private use
    assert check_questions(newer) == newer  # Python 3.11's isprintable() is False for the first two
    (tmp_path / "cr.txt").write_bytes(b"Who?\rWhere?\r")
    r = run(rocketkv_bin, env, "ask", "--cache", kv, "--questions-file", tmp_path / "cr.txt", "--max-new-tokens", "2",
            "--json")  # fmt: skip
    assert r.returncode == 0 and [json.loads(line)["question"] for line in r.stdout.splitlines()] == ["Who?", "Where?"]


def test__rebuild_hint__names_the_document_by_its_absolute_path_from_any_directory(rocketkv_bin, env, tiny_model_dir,
                                                                                  tmp_path):  # fmt: skip
    """A cache records its document's absolute path: the "rebuild it with" command a damaged file
    prints works from any directory (quoted for the shell: this name has a space)."""
    work, elsewhere = tmp_path / "work", tmp_path / "elsewhere"
    work.mkdir()
    elsewhere.mkdir()
    (work / "my doc.txt").write_text("The code is 4172. " * 40)
    r = run(rocketkv_bin, env, "ingest", "my doc.txt", "-o", "d.kv", "--model", tiny_model_dir, "--budget", "64",
            cwd=work)  # fmt: skip
    assert r.returncode == 0, r.stderr
    data = bytearray((work / "d.kv").read_bytes())
    data[-100] ^= 0xFF  # a byte of the payload: the header still reads, the digest does not match
    (work / "d.kv").write_bytes(bytes(data))
    r = run(rocketkv_bin, env, "inspect", work / "d.kv", cwd=elsewhere)
    line = assert_one_line_error(r)
    assert f"rebuild it with: rocketkv ingest '{work / 'my doc.txt'}' -o {work / 'd.kv'} --force" in line, line


def test__a_questions_file_without_questions__says_so(rocketkv_bin, env, kv, tmp_path):
    """A questions file given but empty (or blank lines only) is named in the error, exit 1; no
    questions at all stays a usage error (exit 2)."""
    (tmp_path / "empty.txt").write_text("\n  \n")
    r = run(rocketkv_bin, env, "ask", "--cache", kv, "--questions-file", tmp_path / "empty.txt")
    assert f"no questions in {tmp_path / 'empty.txt'}" in assert_one_line_error(r)
    assert "no questions in stdin" in assert_one_line_error(
        run(rocketkv_bin, env, "ask", "--cache", kv, "--questions-file", "-", stdin="")
    )
    assert run(rocketkv_bin, env, "ask", "--cache", kv).returncode == 2


def test__comment_lines__are_not_asked(rocketkv_bin, env, kv, tmp_path):
    """A line that is `#` alone or starts with `# ` (after spaces) is a comment in a questions file,
    in `ask -` and in a chat piped in (it was asked as a question), and their count is said;
    `#1 …` and `#word` are questions; comments alone are no question."""
    expected = run(rocketkv_bin, env, "ask", "--cache", kv, QS[0], QS[2], "--json")
    (tmp_path / "qs.txt").write_text(f"# about the document\n{QS[0]}\n  # an aside\n#\n\n{QS[2]}\n")
    from_file = run(rocketkv_bin, env, "ask", "--cache", kv, "--questions-file", tmp_path / "qs.txt", "--json")
    chatted = run(rocketkv_bin, env, "chat", "--cache", kv, "--json", stdin=(tmp_path / "qs.txt").read_text())
    drop = lambda out: [{k: v for k, v in json.loads(x).items() if not k.endswith("_s")} for x in out.splitlines()]
    assert from_file.returncode == 0 and drop(from_file.stdout) == drop(expected.stdout), from_file.stderr
    assert "3 comment lines (starting '# ') not asked" in from_file.stderr, from_file.stderr
    hashed = run(rocketkv_bin, env, "ask", "--cache", kv, "-", "--json", stdin="#1 code?\n#MeToo: when?\n")
    assert [json.loads(x)["question"] for x in hashed.stdout.splitlines()] == ["#1 code?", "#MeToo: when?"]
    assert chatted.returncode == 0 and drop(chatted.stdout) == drop(expected.stdout), chatted.stderr
    assert "no questions in stdin" in assert_one_line_error(run(rocketkv_bin, env, "ask", "--cache", kv, "-",
                                                                stdin="# only a comment\n"))  # fmt: skip


def test__chat_without_a_question_piped_in__ends_before_the_model_loads(rocketkv_bin, env, kv):
    """`chat < /dev/null` (or blank and comment lines only) says so in one line, exit 1, without
    importing torch (it loaded the model first, then ended with nothing)."""
    for stdin in ("", "\n  \n# nothing to ask\n"):
        r = subprocess.run([sys.executable, "-X", "importtime", "-m", "rocketkv_cli", "chat", "--cache", str(kv)],
                           input=stdin, capture_output=True, text=True, env=env, timeout=300)  # fmt: skip
        imported = {line.rsplit("|", 1)[-1].strip() for line in r.stderr.splitlines() if "import time:" in line}
        errors = [line for line in r.stderr.splitlines() if line.startswith("Error:")]
        assert r.returncode == 1 and errors == ["Error: no questions in stdin — write one question per line"], r.stderr
        assert "torch" not in imported and r.stdout == ""


def test__cli_dtype_names__are_the_loaders():
    """`--dtype` is checked at parse time against cli/'s own list (cli/ imports no torch): it must
    name exactly what `model.loading` loads, and auto."""
    from rocketkv_cli.cli.options import MODEL_DTYPES
    from rocketkv_cli.model.loading import DTYPES

    assert sorted(MODEL_DTYPES) == sorted(["auto", *DTYPES])


def test__a_cache_file_named_dash__is_read_as_a_file(rocketkv_bin, env, kv, tmp_path):
    """`-` is refused as a cache (stdin cannot hold one), but a file that is named `-` (given as
    `./-`, which the option parser shortens to `-`) is still a cache file."""
    import shutil

    shutil.copy(kv, tmp_path / "-")
    r = run(rocketkv_bin, env, "inspect", "./-", cwd=tmp_path)
    assert r.returncode == 0 and "storage" in r.stdout, r.stderr
    assert "cannot come from stdin" in assert_one_line_error(run(rocketkv_bin, env, "inspect", "-"), code=2)


def test__answer_line_and_verbose_timing__count_the_tokens_decoded_not_only_those_kept():
    """An answer cut at a loop kept 5 of the 9 tokens decoded in its 1.0 s of decode: the line after
    it says both, and --verbose's per-token time divides by the steps run (8), not the kept (4)."""
    from rocketkv_cli.cli.answers import answer_log_of, decode_timing

    record = {"n_answer_tokens": 5, "n_decoded_tokens": 9, "stop_reason": "repetition", "prefill_s": 0.5,
              "decode_s": 1.0}  # fmt: skip
    assert answer_log_of(record) == "answered in 1.50s (5 tokens of 9 decoded, stop: repetition)"
    assert decode_timing(record) == ("decode 9 tokens (125 ms/token)", 1.0)
    whole = {k: v for k, v in record.items() if k != "n_decoded_tokens"} | {"stop_reason": "eos"}
    assert answer_log_of(whole) == "answered in 1.50s (5 tokens, stop: eos)"
    assert decode_timing(whole) == ("decode 5 tokens (250 ms/token)", 1.0)


def test__chat_with_questions_piped_in__ctrl_c_stops_it_with_130(rocketkv_bin, env, kv, tmp_path):
    """At a prompt Ctrl-C cancels one answer and the session goes on; with questions piped in (a
    script) it used to do the same and exit 0, the interrupted answer missing from the output:
    it stops the command as it stops `ask` (exit 130, "interrupted")."""
    from reliability_cases import default_sigint

    questions = tmp_path / "q.txt"
    questions.write_text("".join(f"What is item {i}?\n" for i in range(2000)))
    with questions.open() as stdin:
        chat = subprocess.Popen([rocketkv_bin, "chat", "--cache", str(kv), "--no-server", "--max-new-tokens", "64"],
                                stdin=stdin, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                                preexec_fn=default_sigint)  # fmt: skip
        try:
            for _ in range(4):  # answering
                assert chat.stdout.readline(), chat.stderr.read()
            chat.send_signal(signal.SIGINT)
            out, err = chat.communicate(timeout=120)
        finally:
            chat.kill()
    assert chat.returncode == 130 and "Error: interrupted" in err and "answer cancelled" not in err, err
    assert out.count("Q: ") < 1000  # it stopped, rather than answering the rest


def test__ask_a_large_document_in_memory__says_it_is_not_saved_and_how_to_keep_it(rocketkv_bin, env, tiny_model_dir,
                                                                                   tmp_path):  # fmt: skip
    """`ask BOOK.txt QUESTION` read the whole KJV in memory for 76 minutes with nothing saying that
    nothing is kept; a document over 256 KB now gets a note, before the work, naming the ingest that
    keeps it. A small one does not (the note would be noise)."""
    big = tmp_path / "big.txt"
    big.write_text("the river ran by the stone wall.\n" * 9000)  # 297 KB
    proc = subprocess.Popen([rocketkv_bin, "ask", str(big), "Where?", "--model", str(tiny_model_dir)], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        first = proc.stderr.readline()
    finally:
        proc.kill()
        proc.wait(timeout=30)
    assert first.startswith(f"rocketkv: note: {big} (0.3 MB) is read in memory for this command and not saved"), first
    assert f"rocketkv ingest {big} -o big.txt.kv (resumable), then rocketkv ask --cache big.txt.kv" in first, first
    # (the cache in the current folder: the document's may be read-only, such as a shared data folder)
    small = tmp_path / "small.txt"
    small.write_text("The secret code is 4242.\n")
    r = run(rocketkv_bin, env, "ask", small, "What is the code?", "--model", tiny_model_dir, "--max-new-tokens", "2")
    assert r.returncode == 0 and "read in memory" not in r.stderr, r.stderr


def test__ask_json__a_cache_name_that_is_not_utf8_stays_valid_json(rocketkv_bin, env, kv, tmp_path):
    """A cache file named with a byte that is not UTF-8 was written raw into the `--json` line (not
    UTF-8, so no JSON parser read it); it is now the escape `\\udcff`, which parses back to the name."""
    odd = tmp_path / os.fsdecode(b"doc\xff.kv")
    odd.write_bytes(kv.read_bytes())
    r = subprocess.run([rocketkv_bin, "ask", "--cache", os.fsencode(odd), "What is the code?", "--json",
                        "--max-new-tokens", "2"], capture_output=True, env=env, timeout=300)  # fmt: skip
    assert r.returncode == 0, r.stderr
    row = json.loads(r.stdout.decode("utf-8"))  # strict UTF-8
    assert row["cache"] == str(odd)


def test__a_stdout_that_is_not_utf8__gets_the_answer_escaped(rocketkv_bin, env, kv):
    """With PYTHONIOENCODING=ascii (or a Latin-1 locale) an answer with a character the encoding
    lacks was lost: exit 1, "unexpected UnicodeEncodeError". It is written escaped now, and --json
    stays valid JSON (\\u escapes) with the same record."""
    question = "Écrivez: où est le code? ☃"
    utf8 = run(rocketkv_bin, env, "ask", "--cache", kv, question)
    utf8_json = run(rocketkv_bin, env, "ask", "--cache", kv, question, "--json")
    ascii_env = {**env, "PYTHONIOENCODING": "ascii"}
    escaped = run(rocketkv_bin, ascii_env, "ask", "--cache", kv, question)
    escaped_json = run(rocketkv_bin, ascii_env, "ask", "--cache", kv, question, "--json")
    assert all(r.returncode == 0 for r in (utf8, utf8_json, escaped, escaped_json)), (
        escaped.stderr + escaped_json.stderr
    )
    assert not utf8.stdout.isascii() or not utf8_json.stdout.isascii()  # the check checks something
    assert escaped.stdout == utf8.stdout.encode("ascii", "backslashreplace").decode("ascii")
    drop = lambda out: {k: v for k, v in json.loads(out).items() if not k.endswith("_s")}
    assert escaped_json.stdout.isascii() and drop(escaped_json.stdout) == drop(utf8_json.stdout)


def test__chat_doc_from_a_pipe__reads_the_whole_document(rocketkv_bin, env, doc, tiny_model_dir):
    """`echo Q | rocketkv chat <(cat doc.txt)`: the check made before the model loads read the
    pipe's first block and dropped it ("document /dev/fd/63 is empty"); a regular file is checked,
    a pipe is read once, by the ingest."""
    expected = run(rocketkv_bin, env, "chat", doc, "--model", tiny_model_dir, "--json", "--no-server",
                   stdin=QS[0] + "\n")  # fmt: skip
    r = subprocess.run(["bash", "-c", f"echo {shlex.quote(QS[0])} | {shlex.quote(rocketkv_bin)} chat <(cat "
                        f"{shlex.quote(str(doc))}) --model {shlex.quote(str(tiny_model_dir))} --json --no-server"],
                       capture_output=True, text=True, env=env, timeout=300)  # fmt: skip
    assert expected.returncode == 0 and r.returncode == 0, r.stderr
    drop = lambda out: [{k: v for k, v in json.loads(x).items() if not k.endswith("_s") and k != "cache"}
                        for x in out.splitlines()]  # fmt: skip
    assert drop(r.stdout) == drop(expected.stdout) and len(drop(r.stdout)) == 1


@pytest.mark.parametrize("command", ["eval", "bench"])
def test__report_json__refused_before_the_run_as_an_output_file_is(rocketkv_bin, env, command, tmp_path):
    """`eval --json` and `bench --json` replaced an existing report without --force, replaced a
    FIFO or a device node with a file, and bench found a missing folder only after minutes of
    measurement (the report lost): each is now refused before the model loads."""
    kept = tmp_path / "kept.json"
    kept.write_text('{"precious": 1}')
    fifo = tmp_path / "fifo.json"
    os.mkfifo(fifo)
    for target, extra, says in [(kept, [], "already exists — pass --force to replace it"),
                                (fifo, ["--force"], "is not a regular file; rocketkv will not replace it"),
                                (tmp_path / "nodir" / "r.json", [], "does not exist"),
                                (tmp_path, [], "is a directory — give a file name with --json")]:  # fmt: skip
        r = run(rocketkv_bin, env, command, "--json", target, *extra)
        assert r.returncode == 1 and says in assert_one_line_error(r), (target, r.stderr)
        assert "loaded" not in r.stderr, r.stderr
    assert kept.read_text() == '{"precious": 1}' and stat.S_ISFIFO(fifo.stat().st_mode)


@pytest.mark.parametrize("command", ["ask", "chat", "summarize", "batch"])
def test__server_and_no_server_together__a_usage_error(rocketkv_bin, env, kv, command, tmp_path):
    """`--server URL --no-server` answered in this process, the URL ignored: now exit 2, one line."""
    first = {"ask": ["--cache", kv, "Who?"], "chat": ["--cache", kv], "summarize": ["--cache", kv],
             "batch": [tmp_path / "m.jsonl"]}[command]  # fmt: skip
    r = run(rocketkv_bin, env, command, *first, "--no-server", "--server", "unix:/nowhere.sock", stdin="Who?\n")
    assert "--server names a server and --no-server says answer here" in assert_one_line_error(r, code=2)


def test__h_is_help_and_version_names_the_tool(rocketkv_bin, env):
    """`-h` was "No such option: -h" (exit 2); `--version` printed a bare "0.1.0"."""
    from rocketkv_cli import __version__

    for args in (["-h"], ["ask", "-h"], ["serve", "status", "-h"]):
        r = run(rocketkv_bin, env, *args)
        assert r.returncode == 0 and r.stdout.startswith("Usage: rocketkv") and r.stderr == "", (args, r.stderr)
        assert r.stdout == run(rocketkv_bin, env, *args[:-1], "--help").stdout
    r = run(rocketkv_bin, env, "--version")
    assert r.returncode == 0 and r.stdout == f"rocketkv {__version__}\n", r.stdout


def test__a_full_disk_under_stdout__no_promise_of_a_resume(rocketkv_bin, env, kv):
    """`inspect … > /dev/full` (ENOSPC on stdout): one line saying the disk is full; the hint that
    "an ingest or a batch resumes where it stopped" was given to every command, whatever it was."""
    with open("/dev/full", "w") as full:
        r = subprocess.run([rocketkv_bin, "inspect", str(kv)], stdout=full, stderr=subprocess.PIPE, text=True, env=env,
                           timeout=120)  # fmt: skip
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.strip() == "Error: no space left on the device — free some space and run the command again", (
        r.stderr
    )


def test__stderr_reader_gone__answers_and_files_still_written_exit_0(rocketkv_bin, env, kv, doc, tiny_model_dir):
    """stderr a pipe nobody reads any more (`2> >(head -1)`): Rich's broken-pipe handler copied
    /dev/null over stdout and exited 1, so the answers were lost and an ingest that wrote its file
    failed. The status lines are dropped; stdout gets everything, exit 0."""

    def without_stderr(*args):
        read_end, write_end = os.pipe()
        os.close(read_end)  # the reader is gone before the first status line
        try:
            return subprocess.run([rocketkv_bin, *map(str, args)], stdout=subprocess.PIPE, stderr=write_end,
                                  text=True, env=env, timeout=300)  # fmt: skip
        finally:
            os.close(write_end)

    asked = run(rocketkv_bin, env, "ask", "--cache", kv, "--format", "lines", "--no-server", "Who?", "What?")
    assert asked.returncode == 0 and len(asked.stdout.splitlines()) == 2, asked.stderr
    r = without_stderr("ask", "--cache", kv, "--format", "lines", "--no-server", "Who?", "What?")
    assert (r.returncode, r.stdout) == (0, asked.stdout)
    out = doc.parent / "no-stderr.kv"
    r = without_stderr("ingest", doc, "-o", out, "--model", tiny_model_dir, "--budget", "64")
    assert (r.returncode, r.stdout.strip()) == (0, str(out))
    assert run(rocketkv_bin, env, "inspect", out).returncode == 0


@pytest.mark.parametrize("value", ["0", "00"])
def test__a_terminal_width_of_0__errors_still_shown(rocketkv_bin, env, value, tmp_path):
    """`COLUMNS=0` made Rich draw every line at width 0: nothing on stderr, the error lost."""
    r = run(rocketkv_bin, {**env, "COLUMNS": value, "LINES": "0"}, "ask", "--cache", tmp_path / "nope.kv", "Who?",
            "--no-server")  # fmt: skip
    error = assert_one_line_error(r)
    assert error.startswith(f"Error: cache file not found: {tmp_path / 'nope.kv'}"), error
    assert error.endswith(f"build one with: rocketkv ingest DOC -o {tmp_path / 'nope.kv'}"), error
    r = run(rocketkv_bin, env, "ask", "--cache", tmp_path / "notes.txt", "Who?", "--no-server")
    error = assert_one_line_error(r)  # not "-o notes.txt": a cache written under a text file's name
    assert error.endswith("give a .kv file, written by: rocketkv ingest DOC -o FILE.kv"), error


def test__a_home_too_long_for_a_socket__asks_answer_here(rocketkv_bin, env, kv, tmp_path):
    """A `$ROCKETKV_HOME` whose serve.sock path is over the 107 bytes a Unix socket can name: no
    server can listen there, so `ask` answers in its process; it refused ("socket path … is longer
    than 107 bytes") unless --no-server was given."""
    home = tmp_path / ("h" * 120)
    home.mkdir()
    r = run(rocketkv_bin, {**env, "ROCKETKV_HOME": str(home)}, "ask", "--cache", kv, "--format", "lines", "Who?")
    here = run(rocketkv_bin, env, "ask", "--cache", kv, "--format", "lines", "--no-server", "Who?")
    assert r.returncode == 0 and r.stdout == here.stdout and r.stdout.strip(), r.stderr


def test__c_locale__a_utf8_question_is_asked_as_written(rocketkv_bin, env, kv):
    """`LC_ALL=C` without Python's UTF-8 mode: the arguments' non-ASCII bytes reach Python as
    surrogate escapes, and "日本?" was refused as "not valid UTF-8 text"; bytes that are not UTF-8
    still are."""
    c_env = {**env, "LC_ALL": "C", "PYTHONUTF8": "0"}
    r = subprocess.run([rocketkv_bin, "ask", "--cache", str(kv), "--json", "--no-server", "日本?".encode()],
                       capture_output=True, env=c_env, timeout=300)  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["question"] == "日本?"
    r = subprocess.run([rocketkv_bin, "ask", "--cache", str(kv), "--no-server", b"\xff\xfe?"], capture_output=True,
                       env=c_env, timeout=300)  # fmt: skip
    assert r.returncode == 1 and b"a question is not valid UTF-8 text" in r.stderr, r.stderr


def test__an_option_before_its_command__says_where_it_goes(rocketkv_bin, env):
    """`rocketkv --threads 1 ask …` said only "No such option: --threads"."""
    error = assert_one_line_error(run(rocketkv_bin, env, "--threads", "1", "ask", "--cache", "x.kv", "q?"), code=2)
    assert "No such option: --threads (a command's options go after it: rocketkv ask --threads …)" in error, error
    for args in (["--bogus"], ["--bogus", "ask", "q?"], ["--model", "x", "models"]):  # no command that takes it
        error = assert_one_line_error(run(rocketkv_bin, env, *args), code=2)
        assert "go after it" not in error, error


def test__summarize_budget_below_the_observation_window__a_usage_error_it_can_act_on(rocketkv_bin, env, kv):
    """`summarize --budget 1` said "lower --window-size", an option summarize does not have."""
    error = assert_one_line_error(run(rocketkv_bin, env, "summarize", "--cache", kv, "--budget", "1"), code=2)
    assert "'--budget'" in error and "must be at least 32, got '1'" in error and "window" not in error, error


def test__threads_given_beside_an_openmp_value_it_cannot_read__no_openmp_warnings(rocketkv_bin, env, kv):
    """`OMP_NUM_THREADS=abc rocketkv ask --threads 1 …`: --threads decides, and libgomp's "Invalid
    value for environment variable OMP_NUM_THREADS" was printed twice as torch loaded."""
    for value in ("abc", "0", "2,0"):  # OpenMP takes no 0 either
        r = run(rocketkv_bin, {**env, "OMP_NUM_THREADS": value}, "ask", "--cache", kv, "--threads", "1",
                "--no-server", "Who?")  # fmt: skip
        assert r.returncode == 0 and "libgomp" not in r.stderr and "OMP_NUM_THREADS" not in r.stderr, r.stderr


def test__ingest_prints_a_non_utf8_output_name_as_its_bytes(rocketkv_bin, env, doc, tiny_model_dir, tmp_path):
    """`kv=$(rocketkv ingest …)` with a file name that is not UTF-8: stdout said "doc\\udcff.kv", a
    name no file has; it is the name's bytes now, usable as given."""
    out = os.fsdecode(bytes(tmp_path) + b"/doc\xff.kv")
    r = subprocess.run([rocketkv_bin, "ingest", str(doc), "-o", out, "--model", str(tiny_model_dir), "--budget", "64"],
                       capture_output=True, env=env, timeout=300)  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert r.stdout == os.fsencode(out) + b"\n" and os.path.isfile(os.fsdecode(r.stdout.rstrip(b"\n")))


def test__an_unquoted_question__a_usage_error_naming_the_quoted_question(rocketkv_bin, env, kv):
    """`ask --cache X.kv Who wrote this license?` without quotes was four questions ("Who", "wrote",
    …), four answers of nonsense and seconds each (a new user's slip): a usage error now, before
    the model loads, that shows the question quoted. Questions that each end a sentence stay
    several questions."""
    r = run(rocketkv_bin, env, "ask", "--cache", kv, "Who", "wrote", "this", "license?")
    assert r.returncode == 2 and "loaded" not in r.stderr, r.stderr
    assert ("4 words, each asked as a question of its own: quote a question of several words, "
            "'Who wrote this license?'") in " ".join(r.stderr.split()), r.stderr  # fmt: skip
    from rocketkv_cli.cli.ask import split_question

    for args in (["Who?", "When?"], ["What is the code?", "why"], ["Summarize.", "Why?"]):
        assert not split_question(args), args
    assert split_question(["secret", "code?"]) and not split_question(["", "code?"])
    for args in (["作者是谁？", "它讲了什么?"], ["总结一下", "作者是谁?"], ["Zusammenfassung", "Wärme?"]):  # a review's
        assert not split_question(args), args


def test__a_pdf_or_compressed_file_as_the_document__named_with_what_to_do(rocketkv_bin, env, tiny_model_dir, tmp_path):
    """A PDF was refused as "not valid utf-8 … pass --encoding latin-1" and a .gz as "looks binary …
    pass --encoding utf-16": hints that read either as garbage (from a new user's trial). The format
    is named now, with the step that makes text of it; a text that merely starts like one is text."""
    import gzip
    import zipfile

    pdf = tmp_path / "paper.pdf"
    pdf.write_bytes(b"%PDF-1.7\n%\xe2\xe3\xcf\xd3\n1 0 obj\n<< /Type /Catalog >>\nendobj\n")
    gz = tmp_path / "notes.txt.gz"
    gz.write_bytes(gzip.compress(b"The secret code is 4242.\n" * 20))
    docx = tmp_path / "letter.docx"
    with zipfile.ZipFile(docx, "w") as z:
        z.writestr("word/document.xml", "<w:document/>")
    cases = [
        (pdf, "a PDF", f"extract its text first, e.g. pdftotext -layout {pdf} out.txt"),
        (gz, "gzip-compressed", f"decompress it first: gunzip -c {gz} | rocketkv ingest - -o out.kv"),
        (docx, "a ZIP archive (or a .docx, .odt or .epub)", "extract its text first"),
    ]
    for path, what, hint in cases:
        r = run(rocketkv_bin, env, "ingest", path, "-o", tmp_path / "x.kv", "--model", tiny_model_dir)
        line = assert_one_line_error(r)
        assert line.startswith(f"Error: {path} is {what}, not a text document — {hint}"), line
        assert "loaded" not in r.stderr and not (tmp_path / "x.kv").exists()
    # ask and summarize: the decompressed text piped into the same command; stdin: named as stdin, and
    # the decompressor goes into the pipe (it said "- is gzip-compressed … gunzip -c - | rocketkv ingest …")
    for args, hint in ((["ask", gz, "q?"], f"gunzip -c {gz} | rocketkv ask - QUESTION"),
                       (["summarize", gz], f"gunzip -c {gz} | rocketkv summarize -")):  # fmt: skip
        line = assert_one_line_error(run(rocketkv_bin, env, *args, "--model", tiny_model_dir))
        assert line.endswith(f"decompress it first: {hint}"), line
    packed = gzip.compress(b"The secret code is 4242.\n")
    r = subprocess.run([rocketkv_bin, "ingest", "-", "-o", str(tmp_path / "x.kv"), "--model", str(tiny_model_dir)],
                       input=packed, capture_output=True, env=env, timeout=300)  # fmt: skip
    r = subprocess.CompletedProcess(r.args, r.returncode, r.stdout.decode(), r.stderr.decode())
    line = assert_one_line_error(r)
    assert line.endswith("Error: stdin is gzip-compressed, not a text document — decompress it first: pipe it "
                         "through gunzip -c"), line  # fmt: skip
    text = tmp_path / "bz.txt"
    text.write_text("BZh1 is how a bzip2 file starts; this one is text.\n" * 5)
    assert run(rocketkv_bin, env, "ingest", text, "-o", tmp_path / "x.kv", "--model", tiny_model_dir).returncode == 0


def test__ingest_options_are_checked_against_the_presets_budget_before_the_model_loads(rocketkv_bin, env, tmp_path):
    """`ingest DOC --window-size 800` (the default preset's budget is 1024) was a usage error citing
    "--budget 512"; it passes the option check now, so a missing DOC is what is said. A window over
    the preset's budget is still refused, naming 1024."""
    r = run(rocketkv_bin, env, "ingest", tmp_path / "nope.txt", "--window-size", "800")
    error = assert_one_line_error(r, code=1)
    assert "not found" in error and "budget" not in error, error
    r = run(rocketkv_bin, env, "ingest", tmp_path / "nope.txt", "--window-size", "1100")
    error = assert_one_line_error(r, code=2)
    assert "--budget 1024 is below the observation window (--window-size 1100)" in error, error


def test__batch_with_a_missing_manifest__refused_before_torch(env, tmp_path):
    """`rocketkv batch nope.jsonl` imported torch (seconds) before saying the manifest is missing;
    like ask's and ingest's checks of their files, it answers before torch loads now."""
    probe = "import sys; from rocketkv_cli.entry import main\n"
    probe += "sys.argv = ['rocketkv', 'batch', sys.argv[1]]\n"
    probe += "try:\n    main()\nexcept SystemExit as e:\n    print('torch' in sys.modules, e.code)\n"
    missing = tmp_path / "nope.jsonl"
    r = subprocess.run([sys.executable, "-c", probe, str(missing)], env=env, capture_output=True, text=True,
                       timeout=120)  # fmt: skip
    assert r.stdout.split() == ["False", "1"], (r.stdout, r.stderr)
    assert f"manifest not found: {missing}" in r.stderr, r.stderr


def test__control_characters_in_a_name__written_escaped_on_stderr(rocketkv_bin, env, tmp_path):
    """An ESC in a file name reached the terminal raw in the error line (`\\n` and `\\r` were escaped,
    ESC was not): a name could colour or clear the user's screen. Every control character but tab
    is written as `\\xNN` now."""
    name = tmp_path / "nope\x1b[2Jred\x07.txt"
    r = run(rocketkv_bin, env, "ingest", name)
    error = assert_one_line_error(r, code=1)
    assert "\x1b" not in r.stderr and "\x07" not in r.stderr, r.stderr
    assert "nope\\x1b[2Jred\\x07.txt" in error, error


def test__models__lists_without_importing_torch(env, tmp_path):
    """`rocketkv models` imported torch (3-4 s) to list files; it answers at once now."""
    probe = "import sys; from rocketkv_cli.entry import main\n"
    probe += "sys.argv = ['rocketkv', 'models', '--json']\n"
    probe += "try:\n    main()\nexcept SystemExit as e:\n    print('torch' in sys.modules, e.code)\n"
    home = tmp_path / "home"
    (home / "downloads").mkdir(parents=True)
    (home / "downloads" / "mine.gguf").write_bytes(b"GGUF" + bytes(60))
    r = subprocess.run([sys.executable, "-c", probe], env={**env, "ROCKETKV_HOME": str(home)}, capture_output=True,
                       text=True, timeout=120)  # fmt: skip
    listed, (imported, code) = r.stdout.splitlines()[:-1], r.stdout.splitlines()[-1].split()
    assert (imported, code) == ("False", "0"), (r.stdout, r.stderr)
    assert [json.loads(line)["name"] for line in listed] == ["mine.gguf"], r.stdout  # one object per line


def test__ask_segment_out_of_range__refused_before_the_model_loads(rocketkv_bin, env, kv):
    """`ask --cache X.kv --segment 3` on a cache of one segment loaded the model (seconds) before
    saying the cache has one segment; the file's segments are checked with its other limits now."""
    r = run(rocketkv_bin, env, "ask", "--cache", kv, "--segment", "3", "--no-server", "Code?")
    error = assert_one_line_error(r, code=1)
    assert error == "Error: --segment 3: this cache has one segment (0)", error
    assert "loaded" not in r.stderr, r.stderr


def test__ask_echoes_a_question_with_control_characters_escaped(rocketkv_bin, env, kv):
    """Several questions are echoed as `Q: …` records; an ESC or a CR in one (a pipe's questions:
    `chat` and `ask -`) reached the terminal raw, where it could clear the screen or overwrite the
    line. The echo writes them as `\\xNN` and `\\r` now; the question asked is unchanged."""
    r = run(rocketkv_bin, env, "ask", "--cache", kv, "--no-server", "--format", "qa", "Code?\x1b[2J", "Which\rword?")
    assert r.returncode == 0, r.stderr
    assert "\x1b" not in r.stdout and "\r" not in r.stdout, repr(r.stdout)
    assert "Q: Code?\\x1b[2J\n" in r.stdout and "Q: Which\\rword?\n" in r.stdout, r.stdout


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full (Linux)")
@pytest.mark.parametrize("args", [["--help"], ["--version"], ["ask", "--help"]])
def test__help_or_version_into_a_full_device__one_line_exit_1(rocketkv_bin, env, args):
    """`rocketkv --help > /dev/full` printed a traceback ending in OSError: help and the version are
    printed while the arguments are parsed, outside any command's error handling."""
    with open("/dev/full", "w") as full:
        r = subprocess.run([rocketkv_bin, *args], stdout=full, stderr=subprocess.PIPE, text=True, env=env, timeout=60)
    assert r.returncode == 1 and r.stderr == "Error: cannot write the output: No space left on device\n", r.stderr
