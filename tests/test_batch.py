"""`rocketkv batch` (docs/batch.md), run as the installed CLI on a tiny model: answers equal to
`ask --json`, a build cache shared by equal documents and reused on reruns, bad rows as error
lines with the single-document commands' messages, kill -9 / Ctrl-C then a rerun with no lost
or duplicated row, worker processes, and the progress bar in a pseudo-terminal."""

from __future__ import annotations

import hashlib
import json
import os
import re
import signal
import stat
import subprocess
import time
from pathlib import Path

import pytest
from conftest import run_in_terminal, strip_ansi, text_of_bytes

from rocketkv_cli.batch.manifest import BadRow, Results, Row, parse_row, read_manifest
from rocketkv_cli.cli.batch import with_bare_ray
from rocketkv_cli.errors import OutputError

ASK_KEYS = {"question", "answer", "cache", "n_question_tokens", "n_answer_tokens", "stop_reason", "prefill_s",
            "decode_s"}  # fmt: skip
SUMMARY_KEYS = {"summary", "source", "n_answer_tokens", "stop_reason", "summarize_s", "mode", "rejected"}
TIMES = ("prefill_s", "decode_s", "summarize_s")
OPTS = ["--budget", "64", "--max-new-tokens", "6", "--summary-tokens", "4"]


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    home = tmp_path_factory.mktemp("rkv-home")
    return {**os.environ, "ROCKETKV_HOME": str(home), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}


def run(rocketkv_bin, env, *args, cwd=None):
    return subprocess.run([rocketkv_bin, *map(str, args)], capture_output=True, text=True, env=env, cwd=cwd,
                          timeout=300)  # fmt: skip


def lines_of(path: Path) -> list[dict]:
    """Every line of a results file, each of which must parse as one JSON object."""
    data = path.read_bytes()
    assert data.endswith(b"\n"), data[-200:]
    return [json.loads(line) for line in data.decode().splitlines()]


def without_times(row: dict) -> dict:
    return {k: v for k, v in row.items() if k not in TIMES}


def error_message(result) -> str:
    """The one `Error:` line a failing single-document command printed, without the prefix."""
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
    (line,) = [x for x in result.stderr.splitlines() if x.startswith("Error: ")]
    return line.removeprefix("Error: ")


def write_manifest(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def job(tmp_path_factory, rocketkv_bin, env, tiny_model_dir):
    """A manifest of two equal documents (a file and inline text), two distinct ones (one with a
    summary), and four bad rows; its first run."""
    root = tmp_path_factory.mktemp("batch")
    shared = text_of_bytes(900, seed=1) + "\nThe code is 11.\n"
    (root / "a.txt").write_text(shared)
    (root / "b.txt").write_text(text_of_bytes(900, seed=2) + "\nThe code is 22.\n")
    (root / "bin.txt").write_bytes(b"text\x00more")
    manifest = write_manifest(root / "jobs.jsonl", [
        {"id": "a", "document": "a.txt", "questions": ["What is the code?", "Which word is first?"]},
        {"id": "b", "document": str(root / "b.txt"), "questions": ["What is the code?"], "summary": True},
        {"id": 3, "text": shared, "questions": ["What is the code?"]},
        {"id": "c", "text": text_of_bytes(700, seed=3), "questions": ["Where is the river?"]},
        {"id": "missing", "document": str(root / "nope.txt"), "questions": ["What?"]},
        {"id": "binary", "document": str(root / "bin.txt"), "questions": ["What?"]},
        {"id": "empty-q", "document": "a.txt", "questions": ["What?", " "]},
        '{"id": "broken", "questions": [',
    ])  # fmt: skip
    cmd = ["batch", manifest, "--cache-dir", root / "cache", "--model", tiny_model_dir, *OPTS]
    first = run(rocketkv_bin, env, *cmd)
    return root, manifest, cmd, first


def test__batch__answers_like_ask_json_and_equal_documents_share_one_cache(job, rocketkv_bin, env):
    root, manifest, _, first = job
    assert first.returncode == 1 and "Traceback" not in first.stderr, first.stderr
    assert first.stderr.count("Error:") == 1 and "4 rows failed" in first.stderr
    progress = [line for line in first.stderr.splitlines() if "documents done" in line]  # a pipe: lines, no bar
    n_answers = sum("error" not in r for r in lines_of(root / "jobs.results.jsonl"))
    assert progress and progress[-1].endswith(f"{n_answers} answers written"), (n_answers, first.stderr)
    results = root / "jobs.results.jsonl"
    assert first.stdout.strip() == str(results)
    rows = lines_of(results)
    answers = {(r["id"], r["question_index"]): r for r in rows if "question_index" in r}
    assert set(answers) == {("a", 0), ("a", 1), ("b", 0), (3, 0), ("c", 0)}
    assert all(set(r) == ASK_KEYS | {"id", "question_index", "document_sha256"} for r in answers.values())
    kv_files = sorted((root / "cache").glob("*.kv"))
    assert len(kv_files) == 3  # a.txt and the equal inline text share one file
    assert answers[("a", 0)]["cache"] == answers[(3, 0)]["cache"] != answers[("b", 0)]["cache"]
    assert {Path(r["cache"]) for r in answers.values()} == set(kv_files)
    (summary,) = [r for r in rows if "summary" in r]
    assert (
        summary["id"] == "b"
        and set(summary) == SUMMARY_KEYS | {"id", "document_sha256"}
        and summary["source"] == answers[("b", 0)]["cache"]
    )
    # each answer is what `rocketkv ask --cache FILE --json` gives from the same file
    for key in (("a", 1), ("c", 0)):
        row = answers[key]
        r = run(rocketkv_bin, env, "ask", "--cache", row["cache"], row["question"], "--json", "--max-new-tokens", "6")
        assert r.returncode == 0, r.stderr
        assert without_times(json.loads(r.stdout)) == without_times({k: row[k] for k in ASK_KEYS})


def test__batch_focus__answers_like_ask_focus_json_from_the_same_cache(job, rocketkv_bin, env):
    """`batch --focus 1`: each answer is `ask --cache FILE --focus 1 --json`'s from the row's file
    (the build cache of the first run, reused)."""
    root, manifest, cmd, _ = job
    out = root / "focus.jsonl"
    r = run(rocketkv_bin, env, *cmd, "--focus", "1", "-o", out)
    assert r.returncode == 1 and "4 rows failed" in r.stderr and "Traceback" not in r.stderr, r.stderr
    answers = {(row["id"], row["question_index"]): row for row in lines_of(out) if "question_index" in row}
    row = answers[("b", 0)]  # the row whose answer on this tiny model changes with --focus
    asked = run(rocketkv_bin, env, "ask", "--cache", row["cache"], row["question"], "--focus", "1", "--json",
                "--max-new-tokens", "6")  # fmt: skip
    assert asked.returncode == 0 and "focus: answered from" in asked.stderr, asked.stderr
    assert without_times(json.loads(asked.stdout)) == without_times({k: row[k] for k in ASK_KEYS})
    plain = [x for x in lines_of(root / "jobs.results.jsonl") if (x["id"], x.get("question_index")) == ("b", 0)]
    assert plain[0]["answer"] != row["answer"], "this row no longer tells a focused answer from a plain one"


def test__a_document_that_is_not_a_regular_file__an_error_line_not_a_hang(rocketkv_bin, env, tiny_model_dir,
                                                                          tmp_path):  # fmt: skip
    """/dev/zero was hashed forever and a FIFO blocked the batch (and a server's decode lock):
    each is now its row's error line."""
    fifo = tmp_path / "fifo.txt"
    os.mkfifo(fifo)
    rows = [{"id": "zero", "document": "/dev/zero", "questions": ["q?"]},
            {"id": "fifo", "document": str(fifo), "questions": ["q?"]}]  # fmt: skip
    manifest = write_manifest(tmp_path / "m.jsonl", rows)
    t0 = time.monotonic()
    r = run(rocketkv_bin, env, "batch", manifest, "-o", tmp_path / "out.jsonl", "--model", tiny_model_dir)
    assert r.returncode == 1 and time.monotonic() - t0 < 120 and "Traceback" not in r.stderr, r.stderr
    errors = {x["id"]: x["error"] for x in lines_of(tmp_path / "out.jsonl")}
    assert set(errors) == {"zero", "fifo"} and all("is not a regular file" in e for e in errors.values()), errors


def test__bad_rows__one_error_line_each_with_the_single_document_message(job, rocketkv_bin, env, tmp_path):
    root, _, _, first = job
    errors = {r["line"]: r for r in lines_of(root / "jobs.results.jsonl") if "error" in r}
    assert set(errors) == {5, 6, 7, 8}
    assert [errors[n]["id"] for n in (5, 6, 7, 8)] == ["missing", "binary", "empty-q", None]
    assert errors[5]["error"] == error_message(run(rocketkv_bin, env, "ingest", root / "nope.txt"))
    single = error_message(run(rocketkv_bin, env, "ingest", root / "bin.txt"))  # "… — pass --encoding …"
    assert "--encoding" in single and errors[6]["error"].split(" — ")[0] == single.split(" — ")[0]
    assert "batch reads documents as UTF-8" in errors[6]["error"], errors[6]  # batch has no --encoding
    kv = next((root / "cache").glob("*.kv"))
    assert errors[7]["error"] == error_message(run(rocketkv_bin, env, "ask", "--cache", kv, "What?", " "))
    assert errors[8]["error"].startswith("line 8 is not valid JSON")


def test__rerun__skips_answered_rows_retries_bad_ones_and_reuses_the_cache(job, rocketkv_bin, env):
    root, manifest, cmd, _ = job
    results = root / "jobs.results.jsonl"
    before = lines_of(results)
    stamps = {p: (p.stat().st_ino, p.stat().st_mtime_ns) for p in (root / "cache").glob("*.kv")}
    again = run(rocketkv_bin, env, *cmd)
    assert again.returncode == 1 and "skipping 4 rows already answered" in again.stderr, again.stderr
    assert f"resuming {results}: dropped 4 error lines to retry" in again.stderr, again.stderr  # not "repaired"
    after = lines_of(results)
    assert [r for r in after if "error" not in r] == [r for r in before if "error" not in r]
    assert sorted(r["line"] for r in after if "error" in r) == [5, 6, 7, 8]  # redone once, not duplicated
    assert {p: (p.stat().st_ino, p.stat().st_mtime_ns) for p in stamps} == stamps
    # a new question for a, and c's cache file damaged: a is answered from its cache as it is,
    # c's file is rebuilt; nothing answered before is asked again
    rows = [json.loads(x) for x in manifest.read_text().splitlines()[:4]]
    rows[0]["questions"].append("Which word is last?")
    rows[3]["questions"].append("Which word is first?")
    write_manifest(manifest, rows)
    c_kv = Path(next(r["cache"] for r in after if r["id"] == "c"))
    c_kv.write_bytes(c_kv.read_bytes()[:-100])
    third = run(rocketkv_bin, env, *cmd)
    assert third.returncode == 0, third.stderr
    assert f"rebuilding {c_kv}" in third.stderr
    final = lines_of(results)
    keys = [(r["id"], r["question_index"]) for r in final if "question_index" in r]
    assert len(keys) == len(set(keys)) and not [r for r in final if "error" in r]
    assert set(keys) == {("a", 0), ("a", 1), ("a", 2), ("b", 0), (3, 0), ("c", 0), ("c", 1)}
    assert [r for r in final if r.get("question_index") not in (None,) and (r["id"], r["question_index"]) not in
            (("a", 2), ("c", 1))] == [r for r in after if "question_index" in r]  # fmt: skip
    a_kv = Path(next(r["cache"] for r in final if r["id"] == "a"))
    assert (a_kv.stat().st_ino, a_kv.stat().st_mtime_ns) == stamps[a_kv]
    assert run(rocketkv_bin, env, "inspect", c_kv).returncode == 0


def test__rerun__answers_again_the_rows_whose_document_changed(rocketkv_bin, env, tiny_model_dir, tmp_path):
    """A rerun kept an answer of a document edited since ("The code is 1234." answered after the
    file said 9876): a line records its document's sha256, and a changed document's lines are
    dropped as stale and answered again; an unchanged row is skipped. The results file keeps
    its mode when it is rewritten."""
    doc, other = tmp_path / "doc.txt", tmp_path / "other.txt"
    doc.write_text(text_of_bytes(600, seed=4) + "\nThe code is 1234.\n")
    other.write_text(text_of_bytes(600, seed=5) + "\nThe code is 77.\n")
    manifest = write_manifest(
        tmp_path / "m.jsonl",
        [
            {"id": "x", "document": "doc.txt", "questions": ["Code?"]},
            {"id": "y", "document": "other.txt", "questions": ["Code?"]},
        ],
    )
    results = tmp_path / "r.jsonl"
    cmd = ["batch", manifest, "-o", results, "--model", tiny_model_dir, *OPTS]
    assert run(rocketkv_bin, env, *cmd).returncode == 0
    first = {r["id"]: r for r in lines_of(results)}
    results.chmod(0o644)
    doc.write_text(text_of_bytes(600, seed=4) + "\nThe code is 9876.\n")
    again = run(rocketkv_bin, env, *cmd)
    assert again.returncode == 0, again.stderr
    assert "dropped 1 line of changed or repeated rows or documents" in again.stderr, again.stderr
    second = {r["id"]: r for r in lines_of(results)}
    assert second["y"] == first["y"]  # unchanged: kept as it was, not asked again
    assert (
        second["x"]["document_sha256"] != first["x"]["document_sha256"] and second["x"]["cache"] != first["x"]["cache"]
    )
    assert second["x"]["document_sha256"] == hashlib.sha256(doc.read_bytes()).hexdigest()
    assert stat.S_IMODE(results.stat().st_mode) == 0o644


@pytest.fixture(scope="module")
def many(tmp_path_factory, rocketkv_bin, env, tiny_model_dir):
    """24 documents × 3 questions, and their results from one uninterrupted run on 2 workers."""
    root = tmp_path_factory.mktemp("many")
    manifest = write_manifest(root / "many.jsonl", [
        {"id": f"doc-{i}", "text": text_of_bytes(1200, seed=10 + i % 20), "questions": ["What?", "Who?", "Where?"]}
        for i in range(24)
    ])  # fmt: skip
    ref = root / "reference.jsonl"
    r = run(rocketkv_bin, env, "batch", manifest, "-o", ref, "--cache-dir", root / "ref-cache", "--workers", "2",
            "--model", tiny_model_dir, "--budget", "64", "--max-new-tokens", "24")  # fmt: skip
    assert r.returncode == 0, r.stderr
    return root, manifest, ref


def answers_by_key(path: Path) -> dict:
    """Results keyed by (id, question_index), without timings and with the cache file's name
    only; fails on a duplicated key."""
    out: dict = {}
    for row in lines_of(path):
        key = (row["id"], row["question_index"])
        assert key not in out, f"duplicated {key}"
        out[key] = without_times({**row, "cache": Path(row["cache"]).name})
    return out


def start(rocketkv_bin, env, args) -> subprocess.Popen:
    return subprocess.Popen([rocketkv_bin, *map(str, args)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # fmt: skip


def group_gone(pgid: int, within_s: float = 10) -> bool:
    """No process is left in the process group (the batch and its workers)."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.1)
    return False


def wait_for_lines(path: Path, n: int, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        if path.exists() and path.read_bytes().count(b"\n") >= n:
            return
        time.sleep(0.02)
    pytest.fail(f"the batch ended or stalled before {n} lines: {proc.poll()} {path.exists()}")


@pytest.mark.parametrize("how, workers", [("kill -9", "1"), ("Ctrl-C", "2")])
def test__interrupted_then_rerun__no_lost_or_duplicated_row(many, how, workers, rocketkv_bin, env, tiny_model_dir):
    root, manifest, ref = many
    out = root / f"{workers}.jsonl"
    args = ["batch", manifest, "-o", out, "--cache-dir", root / f"cache-{workers}", "--workers", workers,
            "--model", tiny_model_dir, "--budget", "64", "--max-new-tokens", "24"]  # fmt: skip
    proc = start(rocketkv_bin, env, args)
    wait_for_lines(out, 7, proc)
    if how == "kill -9":
        proc.kill()
        proc.wait(timeout=30)
    else:
        proc.send_signal(signal.SIGINT)
        _, stderr = proc.communicate(timeout=60)
        assert proc.returncode == 130 and "Error: interrupted" in stderr and "Traceback" not in stderr, stderr
        assert f"kept in {out}: rerun the same command to resume" in stderr, stderr
        assert group_gone(proc.pid), "worker processes left behind"
    partial = answers_by_key(out)  # every line whole, none twice
    assert 7 <= len(partial) < 72
    rerun = run(rocketkv_bin, env, *args)
    assert rerun.returncode == 0, rerun.stderr
    assert "already answered" in rerun.stderr
    final = answers_by_key(out)
    assert final == answers_by_key(ref)  # all 72, each once, answered as in the uninterrupted run
    assert all(final[k] == v for k, v in partial.items())


def test__results_file__torn_and_zeroed_lines_are_repaired(tmp_path):
    """What a crash (a cut write, a power loss's zero-filled block) leaves is dropped on reopen;
    whole lines, including other manifests' ids, are kept; the file is valid JSON lines again."""
    path = tmp_path / "r.jsonl"
    good = {"id": "a", "question_index": 0, "question": "Q?", "answer": "x"}
    other = {"id": "elsewhere", "question_index": 0, "question": "Z?", "answer": "y"}
    stale = {"id": "a", "question_index": 1, "question": "old question?", "answer": "z"}
    path.write_bytes(b"".join([json.dumps(good).encode() + b"\n", b"\x00" * 64 + b"\n", json.dumps(other).encode()
                               + b"\n", json.dumps(stale).encode() + b"\n", b'{"id": "a", "error": "x"}\n',
                               b'{"id": "a", "question_index": 2, "quest']))  # fmt: skip
    row = Row(1, "a", None, "text", ("Q?", "new question?", "R?"), False)
    results = Results(path)
    done = results.open([row])
    results.write({"id": "a", "question_index": 1, "question": "new question?", "answer": "w"})
    results.close()
    assert done == {("q", '"a"', 0), ("q", '"elsewhere"', 0)}
    assert results.dropped == {"error": 1, "torn": 2, "stale": 1}
    assert [json.loads(x) for x in path.read_text().splitlines()] == [
        good,
        other,
        {**stale, "question": "new question?", "answer": "w"},
    ]


def test__results_file__a_write_the_disk_refuses__one_error_saying_a_rerun_keeps_the_rows(tmp_path):
    """A results line the file system refuses (here past RLIMIT_FSIZE: EFBIG, as a full disk
    gives ENOSPC) is an OutputError naming the file and saying what a rerun keeps, not the generic
    "no space left" line, which promised a resume to every command (stdout's failures included)."""
    import resource

    path = tmp_path / "r.jsonl"
    results = Results(path)
    results.open([])
    results.write({"id": "a", "question_index": 0, "question": "Q?", "answer": "x"})
    limits = resource.getrlimit(resource.RLIMIT_FSIZE)
    before = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the write fails (EFBIG) instead of killing
    try:
        resource.setrlimit(resource.RLIMIT_FSIZE, (path.stat().st_size + 10, limits[1]))
        with pytest.raises(OutputError) as caught:
            results.write({"id": "a", "question_index": 1, "question": "R?", "answer": "y" * 100})
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, limits)
        signal.signal(signal.SIGXFSZ, before)
        results.close()
    assert caught.value.message == f"cannot write results file {path}: File too large", caught.value.message
    assert caught.value.hint == "fix that and rerun the same command: the answered rows are kept"


@pytest.mark.parametrize(
    "content",
    [
        b"GNU GENERAL PUBLIC LICENSE\nVersion 3, 29 June 2007\n",  # a document given as -o
        b'{"id": "a", "text": "The sky is blue.", "questions": ["What color?"]}\n',  # another manifest
        b'{"id": "a", "text": "t", "questions": ["Q?"]}\n{"id": "b", "text": "u", "questions": ["R?"]}',
        b"\x00\x01binary",
    ],
)
def test__results_file__anything_but_results_is_refused_and_left_as_it_was(content, tmp_path):
    """`batch -o FILE` over a document or a manifest used to "repair" it: the document emptied down
    to the new results, a manifest appended to. Now refused, the file unchanged."""
    path = tmp_path / "r.jsonl"
    path.write_bytes(content)
    with pytest.raises(OutputError, match="not a results file"):
        Results(path).open([Row(1, "a", None, "text", ("Q?",), False)])
    assert path.read_bytes() == content


def test__results_file__one_run_at_a_time_writes_it(tmp_path, rocketkv_bin):
    """Two batches with one -o wrote every answer twice: the second is now refused while the first
    holds the file, from this process or another; the lock file goes with the run that held it."""
    out = tmp_path / "r.jsonl"
    first = Results(out)
    first.open([])
    second = Results(out)
    with pytest.raises(OutputError, match=r"another rocketkv batch is writing .*r\.jsonl now"):
        second.open([])
    second.close()
    manifest = write_manifest(tmp_path / "m.jsonl", [{"id": 1, "text": "t", "questions": ["Q?"]}])
    env = {**os.environ, "ROCKETKV_HOME": str(tmp_path / "home")}
    r = subprocess.run([rocketkv_bin, "batch", str(manifest), "-o", str(out), "--no-server"], capture_output=True,
                       text=True, env=env, timeout=120)  # fmt: skip
    assert r.returncode == 1 and "Error: another rocketkv batch is writing" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr and "loaded" not in r.stderr, r.stderr
    link = tmp_path / "link.jsonl"  # the same file by another name: the same lock
    link.symlink_to(out)
    with pytest.raises(OutputError, match="another rocketkv batch is writing"):
        Results(link).open([])
    first.close()
    assert not (tmp_path / ".r.jsonl.lock").exists()
    again = Results(out)
    assert again.open([]) == set()
    again.close()


def test__results_file__no_lock_file_possible__the_run_goes_on_unlocked(tmp_path, monkeypatch):
    """A folder where no lock file can be made (read-only; its results file writable) or a file
    system without locks (flock's ENOLCK on some NFS mounts): a resume works as before locks."""
    import errno
    import fcntl

    folder = tmp_path / "ro"
    folder.mkdir()
    out = folder / "r.jsonl"
    out.write_text('{"id": 1, "question_index": 0, "question": "Q?", "answer": "A"}\n')
    real_open = os.open

    def no_lock_file(path, *args, **kwargs):
        if str(path).endswith(".lock"):
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(os, "open", no_lock_file)  # root writes a folder of mode 0555 anyway: refuse it here
    results = Results(out)
    assert results.open([]) == {("q", "1", 0)}
    results.close()
    monkeypatch.setattr(os, "open", real_open)

    def no_locks(fd, op):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", no_locks)
    results = Results(out)
    assert results.open([]) == {("q", "1", 0)}  # not "another rocketkv batch is writing" for ever
    results.close()


@pytest.mark.parametrize("note", [b"# my notes about run A", b"TODO: check A2 by hand", b"[1, 2]"])
def test__results_file__a_line_that_is_no_result_is_never_dropped(note, tmp_path):
    """A results file holding results and a line of the user's (a note, another tool's output) had
    that line dropped as if a crash had cut it, exit 0; whole lines are not crash debris (only a
    cut last line, blank lines and a power loss's zeros are), so the file is refused, unchanged."""
    path = tmp_path / "r.jsonl"
    good = json.dumps({"id": "a", "question_index": 0, "question": "Q?", "answer": "x"}).encode()
    content = b"\n".join([note, good, b'{"id": "a", "error": "x"}', note, b""])
    path.write_bytes(content)
    with pytest.raises(OutputError, match="line 1 is not a line `rocketkv batch` writes"):
        Results(path).open([Row(1, "a", None, "text", ("Q?",), False)])
    assert path.read_bytes() == content


@pytest.mark.parametrize("content", [b"", b"\x00" * 512, b"\n\n", b'{"id": "a", "question_index": 0, "quest'])
def test__results_file__what_a_crash_leaves_of_a_new_one_is_resumed(content, tmp_path):
    path = tmp_path / "r.jsonl"
    path.write_bytes(content)
    results = Results(path)
    assert results.open([Row(1, "a", None, "text", ("Q?",), False)]) == set()
    results.close()
    assert path.read_bytes().strip(b"\n") == b""


@pytest.mark.parametrize(
    "line, message",
    [
        ("[1, 2]", "line 1 is not a JSON object"),
        ('{"document": "a.txt", "questions": ["Q?"]}', "line 1: no id"),
        ('{"id": true, "text": "t", "questions": ["Q?"]}', 'line 1: "id" must be a string or an integer, got true'),
        ('{"id": 3.5, "text": "t", "questions": ["Q?"]}', 'line 1: "id" must be a string or an integer, got 3.5'),
        ('{"id": "x", "questions": ["Q?"]}', 'line 1: give "document" (a path) or "text", none given'),
        ('{"id": "x", "text": "t", "document": "a", "questions": ["Q?"]}', "not both"),
        ('{"id": "x", "text": "t", "question": ["Q?"]}', "line 1: unknown field 'question'"),
        ('{"id": "x", "text": "t", "questions": "Q?"}', 'line 1: "questions" must be a list of strings'),
        ('{"id": "x", "text": "t", "questions": [3]}', 'line 1: "questions" must be a list of strings'),
        ('{"id": "x", "text": "t", "questions": ["  "]}', "empty question — give each question some text"),
        ('{"id": "x", "text": "t"}', "line 1: nothing to do"),
        ('{"id": "x", "text": "t", "summary": "yes"}', 'line 1: "summary" must be true or false'),
        ('{"id": "x", "text": "\\ud800", "questions": ["Q?"]}', 'line 1: "text" is not valid UTF-8 text'),
        # each of these stopped the whole batch with an "unexpected" error, the rows after it never run
        ('{"id": "\\ud800", "text": "t", "questions": ["Q?"]}', 'line 1: "id" is not valid Unicode'),
        ('{"id": "x", "document": "a\\u0000b", "questions": ["Q?"]}', 'line 1: "document" "a\\u0000b" is not a file'),
        ('{"id": "x", "document": "\\ud800", "questions": ["Q?"]}', 'line 1: "document" "\\ud800" is not a file'),
        ('{"id": ' + "9" * 5000 + ', "text": "t", "questions": ["Q?"]}', "line 1 cannot be read as JSON (Exceeds"),
        ("[" * 100_000 + "]" * 100_000, "line 1 cannot be read as JSON (nested too deeply)"),
    ],
)
def test__manifest_rows__each_mistake_named(line, message, tmp_path):
    row = parse_row(line.encode(), 1, tmp_path)
    assert isinstance(row, BadRow) and message in row.error, row


def test__manifest_row__a_file_name_that_is_not_utf8_is_a_name():
    """A Latin-1 `café.txt` reaches JSON as Python writes such names (`\\udce9`, `os.fsdecode`): a
    file the row can read, not "half a surrogate pair"."""
    row = parse_row(b'{"id": "x", "document": "caf\\udce9.txt", "questions": ["Q?"]}', 1, Path("/docs"))
    assert not isinstance(row, BadRow) and os.fsencode(row.document) == b"/docs/caf\xe9.txt", row


def test__manifest__paths_relative_to_it_and_duplicate_ids(tmp_path):
    (tmp_path / "sub").mkdir()
    manifest = write_manifest(tmp_path / "sub" / "m.jsonl", [{"id": 1, "document": "d.txt", "summary": True}, "",
                                                             {"id": 1, "text": "t", "questions": ["Q?"]}])  # fmt: skip
    first, second = read_manifest(manifest)
    assert isinstance(first, Row) and first.document == str(tmp_path / "sub" / "d.txt")
    assert isinstance(second, BadRow) and second.line == 3 and "duplicate id 1 (first on line 1)" in second.error
    manifest = write_manifest(tmp_path / "bad-first.jsonl", [{"id": 1, "text": "t", "question": ["Q?"]},
                                                             {"id": 1, "text": "t", "questions": ["Q?"]}])  # fmt: skip
    first, second = read_manifest(manifest)  # the first row is bad (a misspelt field): its error line has id 1
    assert isinstance(first, BadRow) and first.id == 1 and "unknown field" in first.error, first
    assert isinstance(second, BadRow) and "duplicate id 1 (first on line 1)" in second.error, second


def test__bare_ray_option_means_auto():
    assert with_bare_ray(["batch", "m.jsonl", "--ray"]) == ["batch", "m.jsonl", "--ray", "auto"]
    assert with_bare_ray(["batch", "m.jsonl", "--ray", "-q"]) == ["batch", "m.jsonl", "--ray", "auto", "-q"]
    assert with_bare_ray(["batch", "m.jsonl", "--ray", "local"]) == ["batch", "m.jsonl", "--ray", "local"]
    assert with_bare_ray(["ask", "--ray"]) == ["ask", "--ray"]


def test__batch_usage_errors(rocketkv_bin, env, tmp_path):
    manifest = write_manifest(tmp_path / "m.jsonl", [{"id": 1, "text": "t", "questions": ["Q?"]}])
    r = run(rocketkv_bin, env, "batch", manifest, "-o", manifest)
    assert r.returncode == 1 and r.stderr.strip().startswith(f"Error: -o {manifest} is the manifest itself"), r.stderr
    assert manifest.read_text() == '{"id": 1, "text": "t", "questions": ["Q?"]}\n'
    r = run(rocketkv_bin, env, "batch", tmp_path / "none.jsonl")
    assert (
        r.returncode == 1
        and r.stderr.strip() == f"Error: manifest not found: {tmp_path / 'none.jsonl'} — check the path"
    )
    assert run(rocketkv_bin, env, "batch", tmp_path / "none.jsonl", "--workers", "0").returncode == 2
    # devices: /dev/zero as the manifest, or /dev/full as the results file (read to its end to resume), were
    # read until the machine ran out of memory
    r = run(rocketkv_bin, env, "batch", "/dev/zero")
    assert r.returncode == 1 and r.stderr.strip() == "Error: /dev/zero is a device, not a manifest — give a .jsonl file"
    r = run(rocketkv_bin, env, "batch", manifest, "-o", "/dev/full")
    assert r.returncode == 1 and r.stderr.strip().startswith("Error: results path /dev/full is not a regular file"), (
        r.stderr
    )
    # a run that fails before its first line (the model does not load) leaves no empty results file,
    # and an existing one as it was
    r = run(rocketkv_bin, env, "batch", manifest, "-o", tmp_path / "new.jsonl", "--model", "nosuch")
    assert r.returncode == 1 and "unknown model 'nosuch'" in r.stderr and not (tmp_path / "new.jsonl").exists()
    (tmp_path / "old.jsonl").write_bytes(b"")
    r = run(rocketkv_bin, env, "batch", manifest, "-o", tmp_path / "old.jsonl", "--model", "nosuch")
    assert r.returncode == 1 and (tmp_path / "old.jsonl").read_bytes() == b""
    (tmp_path / "none.jsonl").write_bytes(b"")  # a manifest of no rows: a success, whose results file is kept
    r = run(rocketkv_bin, env, "batch", tmp_path / "none.jsonl", "-o", tmp_path / "empty.jsonl", "--no-server")
    assert r.returncode == 0 and (tmp_path / "empty.jsonl").read_bytes() == b"", r.stderr


def test__batch_in_a_terminal__draws_the_bar_with_rates(many, rocketkv_bin, env, tiny_model_dir, tmp_path):
    _, manifest, _ = many
    argv = [rocketkv_bin, "batch", str(manifest), "-o", str(tmp_path / "tty.jsonl"), "--cache-dir",
            str(tmp_path / "cache"), "--model", str(tiny_model_dir), "--budget", "64",
            "--max-new-tokens", "24"]  # fmt: skip
    code, shown = run_in_terminal(argv, env, columns=80)
    plain = strip_ansi(shown)
    assert code == 0 and "Traceback" not in plain and "Error:" not in plain, plain[-3000:]
    assert "━" in plain and "/s" in plain and "questions/s" in plain and "ETA" in plain, plain[-2000:]
    bars = [line for line in plain.replace("\r\n", "\n").replace("\r", "\n").split("\n") if "questions/s" in line]
    assert all("documents" in line and "ETA" in line for line in bars), bars  # one line on 80 columns: no wrap
    assert "0/? documents" not in plain and re.search(r"\b0/\d+ documents", plain), bars[:3]  # the total from the start
    assert len(answers_by_key(tmp_path / "tty.jsonl")) == 72


def test__cache_key__uniform_storage_keys_as_before_format_v5_and_alloc_differs():
    """Build-cache keys of files a batch made before allocated key bits existed must still match
    (the storage record without `key_bits`), and an int4+alloc file must not be taken for int4's."""
    import hashlib

    import torch
    from conftest import make_engine

    from rocketkv_cli.api.rocketkv import RocketKV
    from rocketkv_cli.batch.tasks import BatchSettings, cache_key
    from rocketkv_cli.core.quant import KVStorage

    rk = RocketKV(make_engine("llama", torch.float32))
    settings = BatchSettings(model="tiny", storage=KVStorage("int4"))
    ident = rk.engine.identity
    before = {"document_sha256": "a" * 64, "model_digest": ident.model_digest,
              "tokenizer_digest": ident.tokenizer_digest, "chat_template_digest": ident.chat_template_digest,
              "prompt_template_id": ident.prompt_template_id, "dtype": rk.engine.dtype_name,
              "config": settings.config.to_dict(),
              "storage": {"kv_dtype": "int4", "key_group_tokens": 64, "value_group_dims": 64, "rotation": "none",
                          "sink_tokens": 4},
              "segment_tokens": None}  # fmt: skip
    assert cache_key(rk, "a" * 64, settings) == hashlib.sha256(json.dumps(before, sort_keys=True).encode()).hexdigest()
    alloc = BatchSettings(model="tiny", storage=KVStorage.parse("int4+alloc"))
    assert cache_key(rk, "a" * 64, alloc) != cache_key(rk, "a" * 64, settings)


def test__with_a_running_server__rows_run_there_with_the_same_results(rocketkv_bin, env, tiny_model_dir, tmp_path):
    """A running `rocketkv serve` runs the rows on its warm model (no model load in the batch
    process): the same result lines as without it, in a pipe and a terminal; a row whose
    document is outside the server's --allow-dir becomes that row's error line, the others go on."""
    from test_serve import Served, health

    allowed = tmp_path / "allowed"
    allowed.mkdir()
    doc = allowed / "doc.txt"
    doc.write_text(text_of_bytes(300, seed=4) + "\nThe secret code is 4242.\n")
    outside = tmp_path / "outside.txt"
    outside.write_text("The outside code is 77.\n")
    rows = [{"id": "a", "document": str(doc), "questions": ["What is the code?", "Which word is first?"]},
            {"id": "b", "text": "Tide tables are kept by the harbor master.\n", "questions": ["Who keeps them?"],
             "summary": True}]  # fmt: skip
    manifest = write_manifest(allowed / "m.jsonl", rows)
    args = ["batch", manifest, "--model", tiny_model_dir, *OPTS]
    local = run(rocketkv_bin, env, *args, "-o", allowed / "local.jsonl", "--cache-dir", allowed / "c1", "--no-server")
    assert local.returncode == 0, local.stderr
    s = Served(rocketkv_bin, env, "--idle-timeout", "0", "--allow-dir", allowed, "--allow-dir", tiny_model_dir)
    try:
        remote = run(rocketkv_bin, env, *args, "-o", allowed / "remote.jsonl", "--cache-dir", allowed / "c2")
        assert remote.returncode == 0 and "rows run by the server" in remote.stderr, remote.stderr
        loads = [line for line in remote.stderr.splitlines() if "loaded" in line]
        assert all(line.endswith("(in the server)") for line in loads), "the batch process loaded a model itself"
        assert health(s.server)["served"] == 2  # one request per row

        def same(row: dict) -> dict:  # the .kv paths differ by their cache folder only
            return {k: Path(v).name if k in ("cache", "source") else v for k, v in without_times(row).items()}

        by_key = lambda lines: sorted((same(r) for r in lines), key=json.dumps)  # noqa: E731
        assert by_key(lines_of(allowed / "remote.jsonl")) == by_key(lines_of(allowed / "local.jsonl"))
        made = next(Path(r["cache"]) for r in lines_of(allowed / "remote.jsonl") if r.get("cache"))
        asked = run(rocketkv_bin, env, "ask", "--cache", made, "What is the code?")
        assert asked.returncode == 0, asked.stderr
        assert len(health(s.server)["models"]) == 1, health(s.server)  # the rows' model answers the ask too
        mixed = write_manifest(allowed / "mixed.jsonl", [*rows, {"id": "c", "document": str(outside),
                                                                  "questions": ["What is the code?"]}])  # fmt: skip
        argv = [rocketkv_bin, "batch", str(mixed), "--model", str(tiny_model_dir), *OPTS, "-o",
                str(allowed / "mixed.out.jsonl"), "--cache-dir", str(allowed / "c2")]  # fmt: skip
        code, shown = run_in_terminal(argv, env)
        screen = " ".join(strip_ansi(shown).split())
        assert code == 1 and "Traceback" not in screen, screen[-2000:]
        assert "1 row failed (its error line is in" in screen, screen[-2000:]
        (error,) = [r for r in lines_of(allowed / "mixed.out.jsonl") if "error" in r]
        assert error["id"] == "c" and "outside the server's allowed folders" in error["error"], error
        assert len([r for r in lines_of(allowed / "mixed.out.jsonl") if "error" not in r]) == 4
    finally:
        s.stop()


def test__batch_bar__rates_and_time_left_are_averages_over_the_run():
    """Two small documents done in 16 ms, then a third ingesting for 45 s: the bar read
    "2/3 documents 125.12/s … ETA 0:00:01" the whole time (Rich's windowed speed). Now the rates
    are what is done over the time elapsed, and the time left follows from them."""
    from rich.progress import Progress

    from rocketkv_cli.cli.batch import _Left, _Rates

    now = [100.0]
    bar = Progress(get_time=lambda: now[0], disable=True)
    task_id = bar.add_task("batch", total=3, answers=0)
    now[0] += 0.016
    bar.update(task_id, completed=2, answers=4)
    now[0] += 45
    task = bar.tasks[0]
    assert _Rates().render(task).plain == "0.04/s  0.09 questions/s"  # 2 and 4 in 45.016 s
    assert _Left().render(task).plain == "0:00:23"  # one left at 22.5 s each
    bar.add_task("batch", total=3, answers=0)
    fresh = bar.tasks[1]
    assert _Left().render(fresh).plain == "-:--:--" and _Rates().render(fresh).plain == "–/s  – questions/s"
    # a 60 s model load before the first result is not averaged in (10 s per document: not 40)
    bar.update(1, first=(60.0, 0, 0))
    now[0] += 80
    bar.update(1, completed=2, answers=2)
    assert _Rates().render(bar.tasks[1]).plain == "0.10/s  0.10 questions/s"
    assert _Left().render(bar.tasks[1]).plain == "0:00:10"


def test__run_task__a_progress_that_stops_ends_the_row_without_an_error_line(tmp_path):
    """A server runs a batch row for a client; Ctrl-C on the client went unnoticed until the row's
    ingest had finished (minutes for a book, the decode lock held). The row's ingest now reports
    its chunks to `progress`, which may raise `Stopped`: the task ends there, with no error line
    (the row is not answered, so a rerun does it) and no cache file."""
    import torch
    from conftest import make_engine

    from rocketkv_cli.api.rocketkv import RocketKV
    from rocketkv_cli.batch.tasks import BatchSettings, Stopped, Task, run_task

    rk = RocketKV(make_engine("llama", torch.float32))
    row = Row(1, "a", None, text_of_bytes(3000, seed=2), ("Which letter?",), False)
    settings = BatchSettings(model="tiny")
    calls = []

    def progress(done: int, total: int) -> None:
        calls.append((done, total))
        if done > 0:
            raise Stopped()

    lines = run_task(rk, Task(row, (0,), False), tmp_path, settings, progress=progress)
    with pytest.raises(Stopped):
        next(lines)
    assert calls[-1][0] > 0 and calls[-1][0] < calls[-1][1], calls  # stopped between chunks, before the end
    assert not list(tmp_path.glob("*.kv"))
    whole = list(run_task(rk, Task(row, (0,), False), tmp_path, settings, progress=lambda done, total: None))
    assert len(whole) == 1 and "answer" in whole[0], whole


def test__cache_dir_that_is_a_file__said_so(rocketkv_bin, env, tiny_model_dir, tmp_path):
    """`--cache-dir /dev/null` (or any file) said "File exists — pass --cache-dir" to one who had."""
    manifest = write_manifest(tmp_path / "m.jsonl", [{"id": 1, "text": "t", "questions": ["Q?"]}])
    plain = tmp_path / "plain-file"
    plain.write_text("x")
    for folder in (plain, "/dev/null"):
        r = run(rocketkv_bin, env, "batch", manifest, "-o", tmp_path / "r.jsonl", "--cache-dir", folder, "--model",
                tiny_model_dir, "--no-server")  # fmt: skip
        assert r.returncode == 1 and f"the cache folder {folder} is a file, not a folder" in r.stderr, r.stderr
        assert "Traceback" not in r.stderr and plain.read_text() == "x"


def test__resuming_a_results_file_named_with_a_line_break__one_line_each(rocketkv_bin, env, tiny_model_dir, tmp_path):
    """The rerun's "skipping"/"resuming" lines name the results file on one line (`\\n` written
    out), as every other message does: a name holding a line break used to split the line in two."""
    rows = [{"id": 1, "text": "Some text.", "questions": ["Q?"]}, {"id": 2, "document": "no.txt", "questions": ["Q?"]}]
    manifest = write_manifest(tmp_path / "m.jsonl", rows)
    out = tmp_path / "re\nsults.jsonl"
    cmd = ["batch", manifest, "-o", out, "--model", tiny_model_dir, "--no-server", *OPTS]
    assert run(rocketkv_bin, env, *cmd).returncode == 1  # row 2's document is missing
    again = run(rocketkv_bin, env, *cmd)
    assert again.returncode == 1, again.stderr
    lines = again.stderr.splitlines()
    assert any(line.startswith("rocketkv: skipping 1 row already answered in ") and line.endswith("re\\nsults.jsonl")
               for line in lines), again.stderr  # fmt: skip
    assert any(line.startswith("rocketkv: resuming ") and "re\\nsults.jsonl: dropped" in line for line in lines)
    assert all(line.startswith(("rocketkv:", "Error:")) for line in lines), again.stderr


def test__a_document_given_as_the_manifest__one_error_and_nothing_written(rocketkv_bin, env, tmp_path):
    """`rocketkv batch book.txt` (a new user's slip): every line of the book became an error line of
    a results file written beside it; now one error names the mistake and nothing is written. A
    manifest with some JSON rows still answers them and writes an error line for each other line."""
    doc = tmp_path / "book.txt"
    doc.write_text("Call me Ishmael.\nSome years ago, never mind how long precisely,\n\n{not json either\n")
    r = run(rocketkv_bin, env, "batch", doc)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 1 and len(lines) == 1, r.stderr
    assert lines[0].startswith(
        f"Error: {doc} is not a JSON-lines manifest: none of its 3 lines is JSON (line 1 is "
        "not valid JSON (Expecting value at column 1)) — write one JSON object per line"
    ), lines
    assert sorted(p.name for p in tmp_path.iterdir()) == ["book.txt"]
    from rocketkv_cli.batch.manifest import BadRow, Row, read_manifest

    doc.write_text('Call me Ishmael.\n{"id": 1, "text": "t", "questions": ["Q?"]}\n')
    rows = read_manifest(doc)
    assert [type(r) for r in rows] == [BadRow, Row] and rows[0].error.startswith("line 1 is not valid JSON"), rows


def test__a_manifest_in_a_read_only_folder__results_not_written_beside_it(rocketkv_bin, env, tmp_path):
    """As `ingest DOC` in a read-only folder: the default results file and cache folder would go
    beside the manifest, where the folder's permissions say not to write (root could): refused
    with the options that put them elsewhere, before any model loads."""
    shared = tmp_path / "shared"
    shared.mkdir()
    manifest = write_manifest(shared / "m.jsonl", [{"id": 1, "text": "t", "questions": ["Q?"]}])
    shared.chmod(0o555)
    try:
        r = run(rocketkv_bin, env, "batch", manifest, "--no-server")
        assert r.returncode == 1 and r.stderr.strip().startswith(
            f"Error: the manifest's folder {shared} is read-only (no write permission), so the results and the cache "
            "folder are not written beside it — pass -o RESULTS.jsonl and --cache-dir DIR"), r.stderr  # fmt: skip
        assert sorted(p.name for p in shared.iterdir()) == ["m.jsonl"] and "loaded" not in r.stderr
        r = run(rocketkv_bin, env, "batch", manifest, "--no-server", "-o", tmp_path / "r.jsonl",
                "--cache-dir", tmp_path / "c", "--model", "nosuch")  # fmt: skip
        assert r.returncode == 1 and "unknown model 'nosuch'" in r.stderr, r.stderr
    finally:
        shared.chmod(0o755)
