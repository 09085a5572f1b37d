"""`rocketkv serve`: the real server process (on a Unix socket and on a loopback port), the installed
`rocketkv` as the client in subprocesses, and the official `openai` client. A saved tiny model keeps
each answer to milliseconds; the real presets are covered by the benchmark (docs/serve.md)."""

from __future__ import annotations

import http.server
import json
import os
import re
import select
import shutil
import signal
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from conftest import run_in_terminal, strip_ansi, text_of_bytes

from rocketkv_cli.serve.client import Server, events, health, parse_url

QUESTIONS = ["What is the secret code?", "Which word comes first?", "river stone?", "north light", "seven"]
TIMING_KEYS = ("prefill_s", "decode_s")


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    home = tmp_path_factory.mktemp("serve-home")
    return {**os.environ, "ROCKETKV_HOME": str(home), "HF_HUB_OFFLINE": "1", "ROCKETKV_THREADS": "1"}


def run(rocketkv_bin, env, *args, stdin=None, timeout=300):
    return subprocess.run([rocketkv_bin, *map(str, args)], capture_output=True, text=True, env=env, input=stdin,
                          timeout=timeout)  # fmt: skip


@pytest.fixture(scope="module")
def caches(rocketkv_bin, env, tiny_model_dir, tmp_path_factory):
    """Two caches of different documents (a: the one the tests ask, b: to replace it on disk)."""
    folder = tmp_path_factory.mktemp("serve-docs")
    made = []
    for name, seed in (("a", 0), ("b", 7)):
        doc = folder / f"{name}.txt"
        doc.write_text(text_of_bytes(700, seed=seed) + f"\nThe secret code is {4242 + seed}.\n")
        out = folder / f"{name}.kv"
        r = run(rocketkv_bin, env, "ingest", doc, "-o", out, "--model", tiny_model_dir, "--budget", "64")
        assert r.returncode == 0, r.stderr
        made.append(out)
    return made


class Served:
    """A `rocketkv serve` process; stopped (SIGKILL if it must) when the test ends."""

    def __init__(self, rocketkv_bin, env, *args):
        self.proc = subprocess.Popen([rocketkv_bin, "serve", *map(str, args)], stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True, env=env,
                                     preexec_fn=lambda: signal.signal(signal.SIGHUP, signal.SIG_DFL))  # fmt: skip
        self.stderr_lines: list[str] = []
        self.url = None
        threading.Thread(target=self._read, daemon=True).start()
        deadline = time.monotonic() + 120
        while self.url is None:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"server did not start: {self.proc.poll()} {''.join(self.stderr_lines)}")
            time.sleep(0.05)

    def _read(self):
        for line in self.proc.stderr:
            self.stderr_lines.append(line)
            if m := re.search(r"serving on (\S+)", line):
                self.url = m.group(1)

    @property
    def server(self) -> Server:
        if self.url.startswith("unix:"):
            return Server(path=self.url.removeprefix("unix:"))
        host, port = self.url.removeprefix("http://").rsplit(":", 1)
        return Server(host=host, port=int(port))

    def stop(self):
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=30)


@pytest.fixture
def served(rocketkv_bin, env):
    started = []

    def start(*args, environ=None):
        s = Served(rocketkv_bin, environ or env, *args)
        started.append(s)
        return s

    yield start
    for s in started:
        s.stop()


def without_timings(stdout: str) -> list[dict]:
    rows = [json.loads(line) for line in stdout.splitlines()]
    return [{k: v for k, v in row.items() if k not in TIMING_KEYS} for row in rows]


def test__ask_uses_the_running_server_and_answers_byte_identically(rocketkv_bin, env, caches, served, tiny_model_dir):
    cache = caches[0]
    local = run(rocketkv_bin, env, "ask", "--cache", cache, "--no-server", *QUESTIONS)
    local_json = run(rocketkv_bin, env, "ask", "--cache", cache, "--no-server", "--json", "--cite", *QUESTIONS[:2])
    assert local.returncode == 0 and local_json.returncode == 0, local.stderr + local_json.stderr
    s = served("--idle-timeout", "0")
    sock = Path(env["ROCKETKV_HOME"]) / "serve.sock"
    assert s.url == f"unix:{sock}"
    assert stat.S_IMODE(sock.stat().st_mode) == 0o600  # only this user can connect
    for first in (True, False):  # the first request loads the model and the cache, the second finds them warm
        remote = run(rocketkv_bin, env, "ask", "--cache", cache, *QUESTIONS)
        assert remote.returncode == 0, remote.stderr
        assert remote.stdout == local.stdout
        # the load is said once, to the client that waited for it (as in-process `ask` says it) and in the server's log
        loaded = [line for line in remote.stderr.splitlines() if "loaded " in line]
        assert len(loaded) == first and all(line.endswith("(in the server)") for line in loaded), remote.stderr
    assert sum("loaded " in line for line in s.stderr_lines) == 1, s.stderr_lines
    remote_json = run(rocketkv_bin, env, "ask", "--cache", cache, "--json", "--cite", *QUESTIONS[:2])
    assert without_timings(remote_json.stdout) == without_timings(local_json.stdout)
    info = health(s.server)
    assert info["served"] == 3 and info["caches"] == [str(cache.resolve())], info
    one = run(rocketkv_bin, env, "ask", "--cache", cache, "--format", "lines", "--stream", QUESTIONS[0])
    one_local = run(rocketkv_bin, env, "ask", "--cache", cache, "--no-server", "--format", "lines", "--stream",
                    QUESTIONS[0])  # fmt: skip
    assert one.stdout == one_local.stdout and one.returncode == 0
    verbose = run(rocketkv_bin, env, "ask", "--cache", cache, "-v", QUESTIONS[0])
    assert f"answered by the server at {s.url} (threads: " in verbose.stderr, verbose.stderr  # as --no-server's -v
    assert "--threads" not in verbose.stderr, verbose.stderr
    # the server computes with its own threads (1: OMP_NUM_THREADS of the tests' environment), not the client's
    threads = run(rocketkv_bin, env, "ask", "--cache", cache, "--threads", "2", QUESTIONS[0])
    here = run(rocketkv_bin, env, "ask", "--cache", cache, "--threads", "1", "--no-server", QUESTIONS[0])
    assert threads.returncode == 0 and threads.stdout == here.stdout, threads.stderr
    assert "note: --threads" not in here.stderr, here.stderr
    assert f"note: --threads 2 is not used: the server at {s.url} computes with its own threads" in threads.stderr
    argv = [rocketkv_bin, "ask", "--cache", str(cache), "--threads", "2", "--stream", QUESTIONS[0]]
    both = subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, timeout=300)
    assert both.returncode == 0 and here.stdout.strip() in both.stdout, both.stdout
    # the note is said when the server takes the request, never after (or inside) the answer
    assert both.stdout.index("note: --threads 2") < both.stdout.index(here.stdout.strip()), both.stdout
    missing = run(rocketkv_bin, env, "ask", "--cache", cache.with_name("none.kv"), "--threads", "1", QUESTIONS[0])
    assert missing.returncode == 1 and missing.stderr.startswith("Error: cache file not found"), missing.stderr
    for argv in (["summarize", "--cache", cache.with_name("none.kv")], ["chat", "--cache", cache.with_name("none.kv")]):
        r = run(rocketkv_bin, env, *argv, "--threads", "1")
        assert r.returncode == 1 and r.stderr.startswith("Error: cache file not found"), r.stderr
    # a document read here while the server runs: the note names this document's commands, not DOC placeholders
    doc = cache.with_suffix(".txt")
    read = run(rocketkv_bin, env, "ask", doc, "--model", tiny_model_dir, QUESTIONS[0])
    assert read.returncode == 0, read.stderr
    assert (f"ingest it once (rocketkv ingest {doc}), then rocketkv ask --cache {doc}.kv answers through the "
            "server") in " ".join(read.stderr.split()), read.stderr  # fmt: skip
    shutil.copy(cache, f"{doc}.kv")  # ingested under its default name: only the ask is named
    read = run(rocketkv_bin, env, "summarize", doc, "--model", tiny_model_dir, "--max-new-tokens", "4")
    assert read.returncode == 0, read.stderr
    assert f"rocketkv summarize --cache {doc}.kv answers from its cache through the server" in " ".join(
        read.stderr.split()), read.stderr  # fmt: skip


def test__ask_focus__through_the_server_as_in_process(rocketkv_bin, env, caches, served):
    """`ask --focus` goes to a running server like any ask: the same records and citations, the
    stderr line naming the passages before the answer (in a pipe and a terminal), and a request
    with an option focus cannot take refused by the server too (as the CLI refuses it, exit 2)."""
    cache = caches[0]
    questions = ["What is the secret code?", "Which code is secret?"]
    args = ["ask", "--cache", cache, "--focus", "1", "--cite"]
    local = run(rocketkv_bin, env, *args, "--json", "--no-server", *questions)
    assert local.returncode == 0, local.stderr
    s = served("--idle-timeout", "0")
    remote = run(rocketkv_bin, env, *args, "--json", *questions)
    assert remote.returncode == 0, remote.stderr
    assert health(s.server)["served"] == 1, "the focused questions were not answered by the server"
    assert without_timings(remote.stdout) == without_timings(local.stdout)
    rows = without_timings(remote.stdout)
    assert [c["text"] for row in rows for c in row["citations"]] == ["The secret code is 4242."] * 2
    notes = [line for line in remote.stderr.splitlines() if "focus: answered from lines" in line]
    assert notes == [line for line in local.stderr.splitlines() if "focus: answered from lines" in line]
    assert len(notes) == 2, remote.stderr
    code, shown = run_in_terminal([rocketkv_bin, *map(str, args), questions[0]], env)
    screen = strip_ansi(shown)
    assert code == 0 and "The secret code is 4242." in screen and "Traceback" not in screen, screen[-2000:]
    assert [line for line in screen.splitlines() if "rocketkv: focus:" in line and line.startswith("rocketkv:")], (
        screen[-2000:]
    )
    assert health(s.server)["served"] == 2
    # `chat --focus` through the server: one request per question, the same records and notes
    chat = run(rocketkv_bin, env, "chat", "--cache", cache, "--focus", "1", "--cite", "--json",
               stdin="\n".join(questions) + "\n")  # fmt: skip
    assert chat.returncode == 0 and without_timings(chat.stdout) == without_timings(local.stdout), chat.stderr
    assert [line for line in chat.stderr.splitlines() if "focus: answered from lines" in line] == notes
    assert health(s.server)["served"] == 5  # the chat's check, then its two questions
    # a passage of several lines is listed on one row under "Sources:", every row indented
    shown = run(rocketkv_bin, env, "ask", "--cache", cache, "--focus", "2", "--cite", questions[0])
    rows = shown.stdout.split("Sources:\n")[1].splitlines()
    assert rows and all(row.startswith("  [") for row in rows), shown.stdout
    body = {"cache": str(cache.resolve()), "questions": questions[:1], "focus": 1, "dense": True}
    from rocketkv_cli.errors import UsageError

    with pytest.raises(UsageError, match="'focus' answers from the passages it re-reads, greedy: drop dense"):
        list(events(s.server, "/v1/rocketkv/ask", body))
    assert run(rocketkv_bin, env, *args, questions[0]).returncode == 0, "the server stopped serving"


def test__errors_are_the_same_one_line_with_and_without_the_server(rocketkv_bin, env, caches, served, tmp_path,
                                                                    tiny_model_dir):  # fmt: skip
    served("--idle-timeout", "0")
    bad = tmp_path / "bad.kv"
    bad.write_bytes(b"\x00" * 64)
    cases = [
        ("--cache", tmp_path / "missing.kv", "q?"),
        ("--cache", bad, "q?"),
        ("--cache", caches[0], "--segment", "3", "q?"),
        ("--cache", caches[0], "--topk", "0", "q?"),
    ]
    for args in cases:
        here = run(rocketkv_bin, env, "ask", "--no-server", *args)
        there = run(rocketkv_bin, env, "ask", *args)
        assert (there.returncode, there.stdout) == (here.returncode, here.stdout), (args, there.stderr)
        assert here.returncode in (1, 2) and "Traceback" not in there.stderr
        error = [line for line in there.stderr.splitlines() if line.startswith("Error:")]
        assert error == [line for line in here.stderr.splitlines() if line.startswith("Error:")], args
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    for doc in (caches[0], empty):  # a DOC that fails its checks: the error alone, no advice about the server
        r = run(rocketkv_bin, env, "ask", doc, "q?")
        assert r.returncode == 1 and "a server is running" not in r.stderr, r.stderr
    r = run(rocketkv_bin, env, "ask", caches[0].with_suffix(".txt"), "What is the secret code?", "--model",
            tiny_model_dir, "--budget", "64", "--max-new-tokens", "4")  # fmt: skip
    assert r.returncode == 0 and "a server is running" in r.stderr.splitlines()[-1], r.stderr  # after the answer
    r = run(rocketkv_bin, env, "summarize", caches[0].with_suffix(".txt"), "--model", tiny_model_dir, "--budget", "64",
            "--max-new-tokens", "4")  # fmt: skip
    assert r.returncode == 0 and "rocketkv summarize --cache" in r.stderr.splitlines()[-1], r.stderr


def test__a_server_named_with_server_must_answer(rocketkv_bin, env, caches, tmp_path):
    r = run(rocketkv_bin, env, "ask", "--cache", caches[0], "--server", f"unix:{tmp_path}/none.sock", "q?")
    assert r.returncode == 1 and "no rocketkv server answers at unix:" in r.stderr and "Traceback" not in r.stderr
    r = run(rocketkv_bin, env, "ask", "--cache", caches[0], "--server", "ftp://x", "q?")
    assert r.returncode == 2 and "Traceback" not in r.stderr
    # named by the environment: the message names it, not an option nobody typed
    r = run(rocketkv_bin, {**env, "ROCKETKV_SERVER": "ftp://x"}, "ask", "--cache", caches[0], "q?")
    assert r.returncode == 2 and "$ROCKETKV_SERVER=ftp://x" in r.stderr and "--server" not in r.stderr, r.stderr
    r = run(rocketkv_bin, {**env, "ROCKETKV_SERVER": f"unix:{tmp_path}/none.sock"}, "ask", "--cache", caches[0], "q?")
    assert r.returncode == 1 and "($ROCKETKV_SERVER)" in r.stderr and "unset $ROCKETKV_SERVER" in r.stderr, r.stderr


@pytest.mark.parametrize("url, said", [
    ("http://127.0.0.1:0", "the port is not a number in 1-65535"),  # was port 80
    ("http://user:pw@127.0.0.1:5", "give http://host:port alone"),  # these were dropped unsaid
    ("http://127.0.0.1:5/?x=1", "give http://host:port alone"),
    ("http://127.0.0.1:5#top", "give http://host:port alone"),
    ("", "--server is empty"),  # was the default socket
    (" ", "--server is empty"),
])  # fmt: skip
def test__server_urls_that_would_be_misread__usage_errors(url, said):
    """`--server` values that were read as something else (port 0 as 80, an empty value as the
    default socket) or lost parts silently: each a usage error naming what is wrong."""
    from rocketkv_cli.cli.remote import check_server_flags
    from rocketkv_cli.errors import UsageError

    with pytest.raises(UsageError, match=re.escape(said)):
        check_server_flags(url, False)
        parse_url(url)


def test__the_client_path_imports_neither_torch_nor_transformers(env, caches, served):
    served("--idle-timeout", "0")
    code = ("import sys\nfrom rocketkv_cli.cli import app\n"
            f"try:\n    app(args=['ask', '--cache', {str(caches[0])!r}, 'q?'])\nexcept SystemExit as e:\n"
            "    assert e.code in (0, None), e.code\n"
            "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))\n")  # fmt: skip
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().splitlines()[-1] == "[]", r.stdout


def test__openai_client_over_tcp_streaming_and_not(rocketkv_bin, env, caches, served, tmp_path):
    openai = pytest.importorskip("openai")
    local = run(rocketkv_bin, env, "ask", "--cache", caches[0], "--no-server", "--json", QUESTIONS[0])
    expected = json.loads(local.stdout)["answer"]
    s = served("--host", "127.0.0.1", "--port", "0", "--allow-dir", caches[0].parent, "--idle-timeout", "0")
    client = openai.OpenAI(base_url=f"{s.url}/v1", api_key="unused", max_retries=0)
    model = f"kv:{caches[0]}"
    done = client.chat.completions.create(model=model, messages=[{"role": "user", "content": QUESTIONS[0]}])
    assert done.choices[0].message.content == expected
    assert done.choices[0].finish_reason in ("stop", "length") and done.usage.completion_tokens >= 1
    pieces = client.chat.completions.create(model=model, messages=[{"role": "user", "content": QUESTIONS[0]}],
                                            stream=True)  # fmt: skip
    assert "".join(c.choices[0].delta.content or "" for c in pieces) == expected
    listed = [m.id for m in client.models.list()]
    assert model.replace(str(caches[0]), str(caches[0].resolve())) in listed
    assert client.models.retrieve(model).id == model  # was a 404 for every model
    with pytest.raises(openai.NotFoundError, match="not found"):
        client.models.retrieve(f"kv:{caches[0].parent}/nope.kv")
    (caches[0].parent / "notes.txt").write_text("not a cache")
    with pytest.raises(openai.NotFoundError, match="not found"):  # a file, but no cache: no model
        client.models.retrieve(f"kv:{caches[0].parent}/notes.txt")
    outside = tmp_path / "elsewhere.kv"
    outside.write_bytes(caches[0].read_bytes())
    with pytest.raises(openai.PermissionDeniedError, match="outside the server's allowed folders"):
        client.chat.completions.create(model=f"kv:{outside}", messages=[{"role": "user", "content": "q"}])
    with pytest.raises(openai.BadRequestError, match="names no cache"):
        client.chat.completions.create(model="gpt-4", messages=[{"role": "user", "content": "q"}])
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model=f"kv:{caches[0].parent}/nope.kv",
                                       messages=[{"role": "user", "content": "q"}])  # fmt: skip
    question = [{"role": "user", "content": QUESTIONS[0]}]
    for field in ({"stop": ["document"]}, {"logprobs": True}, {"response_format": {"type": "json_object"}}):
        with pytest.raises(openai.BadRequestError, match=f"field '{next(iter(field))}' is not supported"):
            client.chat.completions.create(model=model, messages=question, **field)  # was accepted, then ignored
    same = client.chat.completions.create(
        model=model, messages=question, stop=None, logprobs=False, presence_penalty=0, response_format={"type": "text"}
    )  # defaults: fine
    assert same.choices[0].message.content == expected
    assert health(s.server)["status"] == "ok"  # refusals leave it serving


def test__bad_requests_get_json_errors_and_the_server_keeps_serving(env, caches, served):
    import http.client

    key = "a passphrase\twith spaces"  # inner spaces and a tab: printable ASCII, sent as given
    s = served("--host", "127.0.0.1", "--port", "0", "--api-key", key, "--idle-timeout", "0", "--allow-dir",
               caches[0].parent)  # fmt: skip
    host, port = s.url.removeprefix("http://").rsplit(":", 1)

    def send(method, path, body=b"", key=key, headers=None):
        conn = http.client.HTTPConnection(host, int(port), timeout=60)
        hdrs = {"Authorization": f"Bearer {key}", "Content-Type": "application/json", **(headers or {})}
        conn.request(method, path, body=body, headers=hdrs)
        r = conn.getresponse()
        data = r.read()
        conn.close()
        return r.status, json.loads(data)

    loop = caches[0].parent / "loop-a.kv"  # a symlink loop inside the allowed folder
    if not loop.is_symlink():
        loop.symlink_to(caches[0].parent / "loop-b.kv")
        (caches[0].parent / "loop-b.kv").symlink_to(loop)
    surrogate_ingest = json.dumps(
        {"document": f"{caches[0].parent}/\udfff.txt", "output": str(caches[0].parent / "x.kv")}
    )
    surrogate_chat = b'{"model": "kv:/tmp/\\ud800.kv", "messages": [{"role": "user", "content": "q"}]}'
    undecodable = json.dumps({"cache": f"{caches[0].parent}/\udcff.kv", "questions": ["q"]}).encode()
    cases = [
        (("POST", "/v1/rocketkv/ask", b"{not json"), 400),
        (("POST", "/v1/rocketkv/ask", b"[" * 100_000 + b"]" * 100_000), 400),  # nested past Python's recursion
        (("POST", "/v1/rocketkv/ask", json.dumps({"cache": str(loop), "questions": ["q"]}).encode()), 400),
        (("POST", "/v1/ingest", json.dumps({"document": str(loop), "output": str(loop) + ".kv"}).encode()), 400),
        (("POST", "/v1/rocketkv/ask", b"[1]"), 400),
        (("POST", "/v1/rocketkv/ask", b'{"cache": "/tmp/\\ud800.kv", "questions": ["q"]}'), 400),  # a lone surrogate
        (("POST", "/v1/rocketkv/ask", undecodable), 404),  # a name's undecodable byte (\udcff): a path, not found
        (("POST", "/v1/ingest", surrogate_ingest.encode()), 400),
        (("POST", "/v1/chat/completions", surrogate_chat), 400),
        (("POST", "/v1/rocketkv/ask", json.dumps({"cache": "rel.kv", "questions": ["q"]}).encode()), 400),
        (("POST", "/v1/rocketkv/ask", json.dumps({"cache": str(caches[0]), "questions": []}).encode()), 400),
        (
            (
                "POST",
                "/v1/rocketkv/ask",
                json.dumps({"cache": str(caches[0]), "questions": ["q"], "temperature": -1}).encode(),
            ),
            400,
        ),  # fmt: skip
        (("POST", "/v1/rocketkv/ask", json.dumps({"cache": "/etc/passwd", "questions": ["q"]}).encode()), 403),
        (
            (
                "POST",
                "/v1/rocketkv/ask",
                json.dumps({"cache": str(caches[0]), "questions": ["q"], "top_p": 10**400}).encode(),
            ),
            400,
        ),  # no float holds it: was a 500
        (("POST", "/v1/rocketkv/ask", b"x" * (2 << 20)), 413),
        (("GET", "/v1/nothing-here", b""), 404),
        (
            (
                "POST",
                "/v1/chat/completions",
                json.dumps(
                    {"model": f"kv:{caches[0]}", "messages": [{"role": "user", "content": "q"}], "max_tokens": 10**9}
                ).encode(),
            ),
            400,
        ),  # fmt: skip
    ]
    for (method, path, body), status in cases:
        got, data = send(method, path, body)
        assert got == status, (path, body[:80], got, data)
        assert isinstance(data["error"]["message"], str) and data["error"]["message"]
    got, data = send(
        "POST", "/health", b"{}", headers={"Content-Type": "text/plain"}
    )  # was 415, then "no such endpoint"
    assert got == 405 and data["error"]["message"] == "POST is not allowed on /health", data
    assert data["error"]["hint"] == "use GET, HEAD", data
    long_name = "/tmp/" + "n" * 300 + ".kv"  # was a 500 ("File name too long") and a traceback in the server's log
    for path, body in (("/v1/rocketkv/ask", {"cache": long_name, "questions": ["q"]}),
                       ("/v1/ingest", {"document": long_name, "output": long_name})):  # fmt: skip
        got, data = send("POST", path, json.dumps(body).encode())
        assert got == 400 and "a file name too long" in data["error"]["message"], (path, data)
    for field, said in (({"cite": True}, "field 'cite' must be an integer, not true"),
                        ({"cite": 2.0}, "field 'cite' must be an integer, not 2.0"),
                        ({"questions": "q"}, "field 'questions' must be a list, not a string")):  # fmt: skip
        got, data = send("POST", "/v1/rocketkv/ask", json.dumps({"cache": str(caches[0]), "questions": ["q"],
                                                                **field}).encode())  # fmt: skip
        assert got == 400 and data["error"]["message"] == said, data  # was "has the wrong type (bool)"
    two = json.dumps(
        {"model": f"kv:{caches[1]}", "cache": str(caches[0]), "messages": [{"role": "user", "content": "q"}]}
    ).encode()
    got, data = send("POST", "/v1/chat/completions", two)  # was answered from one and labelled as the other
    assert got == 400 and "name different caches" in data["error"]["message"], data
    relative = json.dumps({"model": "kv:doc.kv", "messages": [{"role": "user", "content": "q"}]}).encode()
    got, data = send("POST", "/v1/chat/completions", relative)  # named in the user's terms: the model field
    assert got == 400 and data["error"]["message"] == "model 'kv:doc.kv' must name the cache by its absolute path"
    assert send("GET", "/v1/models", key="wrong-key-123")[0] == 401
    assert send("POST", "/v1/rocketkv/shutdown", b"{}", key="wrong-key-123")[0] == 401
    ask = json.dumps({"cache": str(caches[0]), "questions": ["q"]}).encode()
    for kind in ("application/jsonx", "application/json-seq", ""):  # were accepted: a prefix matched
        assert send("POST", "/v1/rocketkv/ask", ask, headers={"Content-Type": kind})[0] == 415, kind
    for kind in ("APPLICATION/JSON", "Application/Json; charset=utf-8"):  # were 415: media types ignore case
        got, data = send("POST", "/v1/rocketkv/ask", b'{"questions": ["q"]}', headers={"Content-Type": kind})
        assert got == 400 and data["error"]["message"] == "missing field 'cache'", (kind, data)  # read as JSON
    assert send("POST", "/v1/rocketkv/ask", ask, headers={"Content-Type": "text/plain"})[0] == 415  # a web page's
    assert send("POST", "/v1/rocketkv/ask", ask, headers={"Host": "evil.example:80"})[0] == 403  # DNS rebinding
    for field in ({"model": "/tmp/elsewhere-model"}, {"trust_remote_code": True}):
        got, data = send("POST", "/v1/rocketkv/ask", json.dumps({"cache": str(caches[0]), "questions": ["q"],
                                                                **field}).encode())  # fmt: skip
        assert got == 403, (field, data)
    for model in ("~/models/m", "org/../../tmp/m", "org/name/../m", "~"):  # read from the server's home or folder
        got, data = send("POST", "/v1/rocketkv/ask", json.dumps({"cache": str(caches[0]), "questions": ["q"],
                                                                "model": model}).encode())  # fmt: skip
        assert got == 400 and "must be an absolute path" in data["error"]["message"], (model, data)
    unknown = json.dumps({"cache": str(caches[0]), "questions": ["q"], "model": "no-such-model"}).encode()
    got, data = send("POST", "/v1/rocketkv/ask", unknown)  # the request's mistake, not the server's
    assert got == 400 and data["error"]["type"] == "ModelLoadError", (got, data)
    conn = http.client.HTTPConnection(host, int(port), timeout=60)  # a client that shows a model's load (the CLI)
    conn.request("POST", "/v1/rocketkv/ask", body=unknown, headers={"Authorization": f"Bearer {key}",
                 "Content-Type": "application/json", "X-RocketKV-Events": "status"})  # fmt: skip
    r = conn.getresponse()
    events = [json.loads(line) for line in r.read().splitlines()]  # the load is announced, then fails
    assert r.status == 200 and [e["event"] for e in events] == ["status", "error", "done"], events
    assert events[1]["type"] == "ModelLoadError", events
    for field, value in (("max_tokens", "8"), ("max_tokens", 0), ("max_completion_tokens", 2.5)):
        chat = {"model": f"kv:{caches[0]}", "messages": [{"role": "user", "content": "q"}], field: value}
        got, data = send("POST", "/v1/chat/completions", json.dumps(chat).encode())  # named as the client sent it
        assert got == 400 and f"field '{field}' must be a positive integer" in data["error"]["message"], (got, data)
    misspelt = {"cache": str(caches[0]), "questions": ["q"], "max_tokens": 3}  # ask's field is max_new_tokens
    got, data = send("POST", "/v1/rocketkv/ask", json.dumps(misspelt).encode())  # not answered with the default
    assert got == 400 and "unknown field 'max_tokens'" in data["error"]["message"], (got, data)
    assert "max_new_tokens" in data["error"]["hint"], data
    got, data = send("POST", "/v1/rocketkv/summarize", json.dumps({"cache": str(caches[0]), "focsu": 2}).encode())
    assert got == 400 and "unknown field 'focsu' in a summarize request" in data["error"]["message"], (got, data)
    got, data = send("POST", "/v1/ingest", json.dumps({"document": str(caches[0]), "output": str(caches[0]),
                                                       "overwrite": True}).encode())  # fmt: skip
    assert got == 400 and "'overwrite'" in data["error"]["message"], (got, data)
    got, data = send("POST", "/v1/ingest", json.dumps({"document": str(caches[0].with_suffix(".txt")),
                                                       "output": str(caches[0].parent / ".kv")}).encode())  # fmt: skip
    nameless = str(caches[0].parent / ".kv")  # was "is a link to …, which is not a .kv file"
    assert got == 400 and data["error"]["message"] == f"'output' {nameless!r} has no name before .kv", data
    row = {"line": 1, "id": "a", "document": str(caches[0].with_suffix(".txt")), "text": None, "questions": ["q?"],
           "summary": False}  # fmt: skip
    settings = {"model": "smollm2-135m", "device": "cpu", "dtype": "auto", "config": {}, "storage": "int8"}
    for task, fixed in [({"row": row, "questions": [5], "summary": False}, "indices"),
                        ({"row": row, "questions": [-1], "summary": False}, "indices"),
                        ({"row": {**row, "document": ["x"]}, "questions": [0], "summary": False}, '"document"'),
                        ({"row": {**row, "text": 5, "document": None}, "questions": [0], "summary": False}, '"text"'),
                        ({"row": row, "questions": [0], "summary": "yes"}, "summary"),
                        ({"row": row, "questions": [0], "summary": False}, "device")]:  # fmt: skip
        body = {"task": task, "cache_dir": str(caches[0].parent),
                "settings": {**settings, "device": 5} if fixed == "device" else settings}  # fmt: skip
        got, data = send("POST", "/v1/rocketkv/batch", json.dumps(body).encode())
        assert got == 400 and fixed in data["error"]["message"], (task, got, data)
    body = {
        "task": {"row": row, "questions": [0], "summary": False},
        "settings": settings,
        "cache_dir": str(caches[0].parent / "no-such-folder"),
    }  # was an unexpected FileNotFoundError
    got, data = send("POST", "/v1/rocketkv/batch", json.dumps(body).encode())
    assert got == 400 and "'cache_dir'" in data["error"]["message"] and "not a folder" in data["error"]["message"], data
    for stream in ("yes", 1):  # 1 == True in Python: a truth test or `in (True, False)` took it
        streamy = {"model": f"kv:{caches[0]}", "messages": [{"role": "user", "content": "q"}], "stream": stream}
        got, data = send("POST", "/v1/chat/completions", json.dumps(streamy).encode())
        assert got == 400 and "'stream' must be true or false" in data["error"]["message"], (got, data)
    for n in (1.0, True, 2):  # 1.0 and true equal 1 in Python: they were taken
        got, data = send("POST", "/v1/chat/completions", json.dumps({**streamy, "stream": False, "n": n}).encode())
        assert got == 400 and "only n = 1 is supported" in data["error"]["message"], (n, got, data)
    nulled = {**streamy, "stream": False, "n": None, "max_tokens": 1}  # null: not set, as OpenAI takes it
    got, data = send("POST", "/v1/chat/completions", json.dumps(nulled).encode())
    assert got == 200 and data["choices"][0]["message"]["role"] == "assistant", (got, data)
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    for parts, kind in (([{"type": "text", "text": "What is in this picture?"}, image], "'image_url'"),
                        (["What?"], "'str'")):  # fmt: skip
        pictured = {**streamy, "stream": False, "messages": [{"role": "user", "content": parts}]}
        got, data = send("POST", "/v1/chat/completions", json.dumps(pictured).encode())  # was answered without it
        assert got == 400 and f"a content part of type {kind} is not supported" in data["error"]["message"], data
    sampled = {"cache": str(caches[0]), "temperature": 0.7}  # an ask field summarize would ignore
    got, data = send("POST", "/v1/rocketkv/summarize", json.dumps(sampled).encode())
    assert got == 400 and "unknown field 'temperature'" in data["error"]["message"], (got, data)
    assert health(Server(host=host, port=int(port)))["status"] == "ok"


BAD_SERVE_VALUES = [["--memory-gb", "nan"], ["--memory-gb", "inf"], ["--memory-gb", "-1"], ["--memory-gb", "1e30"],
                    ["--idle-timeout", "nan"], ["--idle-timeout", "-5"], ["--idle-timeout", "1e300"]]  # fmt: skip


def test__a_socket_in_a_missing_folder_or_under_a_file__one_line_nothing_created(rocketkv_bin, env, tmp_path):
    """`--socket /typo/dir/s.sock` made the missing folders and served there; under a file it said
    "File exists: /etc/passwd". Only the default socket's folder ($ROCKETKV_HOME) is made."""
    plain = tmp_path / "plain"
    plain.write_text("x")
    for sock, said in ((tmp_path / "no" / "such" / "s.sock", f"the folder {tmp_path / 'no' / 'such'} does not exist"),
                       (plain / "s.sock", f"{plain} is not a folder")):  # fmt: skip
        r = run(rocketkv_bin, env, "serve", "--socket", sock, "--idle-timeout", "1")
        assert (
            r.returncode == 1
            and r.stderr
            == f"Error: --socket {sock}: {said} — name a socket in an existing "
            "folder, or leave --socket out (default: $ROCKETKV_HOME/serve.sock)\n"
        ), r.stderr
    assert not (tmp_path / "no").exists() and plain.read_text() == "x"


@pytest.mark.parametrize("args", BAD_SERVE_VALUES)
def test__serve_option_values_no_budget_could_be__usage_errors(rocketkv_bin, env, args):
    """NaN gigabytes was "unexpected ValueError" (exit 1), -1 named an internal field in bytes."""
    r = run(rocketkv_bin, env, "serve", *args)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and args[0] in r.stderr, r.stderr
    assert "unexpected" not in r.stderr and "memory_budget" not in r.stderr


def test__a_client_that_leaves_mid_body__no_traceback_and_the_server_serves(env, served):
    """A client that sends half its body and closes the connection: the server logs no traceback
    ("Exception in ASGI application" before) and keeps serving."""
    import socket

    s = served("--host", "127.0.0.1", "--port", "0", "--idle-timeout", "0")
    server = s.server
    with socket.create_connection((server.host, server.port), timeout=10) as conn:
        conn.sendall(b"POST /v1/rocketkv/ask HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 100\r\n\r\n{\"cache\": ")  # fmt: skip
    deadline = time.monotonic() + 30
    while health(server)["active"] > 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.5)
    logged = "".join(s.stderr_lines)
    assert "Traceback" not in logged and "Exception in ASGI" not in logged, logged[-2000:]
    assert health(server)["status"] == "ok"


def test__malformed_http__a_json_400_and_the_server_serves(env, served):
    """Requests h11 cannot parse (a bad chunk size, a negative or doubled Content-Length, a garbage
    request line, a TLS hello) got uvicorn's text/plain "Invalid HTTP request received.": every
    refusal of this server is the JSON error now."""
    import socket

    s = served("--host", "127.0.0.1", "--port", "0", "--idle-timeout", "0")
    server = s.server
    head = b"POST /v1/rocketkv/ask HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
    for raw in (head + b"Transfer-Encoding: chunked\r\n\r\nzz\r\n", head + b"Content-Length: -5\r\n\r\n",
                head + b"Content-Length: 5\r\nContent-Length: 6\r\n\r\n", b"GARBAGE\r\n\r\n",
                bytes.fromhex("16030100a5010000a10303") + b"\0" * 40):  # fmt: skip
        with socket.create_connection((server.host, server.port), timeout=10) as conn:
            conn.sendall(raw)
            reply = b""
            while chunk := conn.recv(65536):
                reply += chunk
        status, _, rest = reply.partition(b"\r\n")
        headers, _, body = rest.partition(b"\r\n\r\n")
        assert status.startswith(b"HTTP/1.1 400") and b"content-type: application/json" in headers.lower(), reply
        assert json.loads(body)["error"]["message"].startswith("malformed HTTP request"), reply
    assert health(server)["status"] == "ok"


def test__a_compressed_body_or_two_framings__refused_by_name(env, served):
    """A gzip body was read as JSON ("not JSON"); Content-Length beside Transfer-Encoding was
    framed by one of them silently (RFC 9112 §6.1 lets a server refuse it: a proxy may have used the
    other). Each gets its own JSON error and the server keeps serving."""
    import gzip
    import socket

    s = served("--host", "127.0.0.1", "--port", "0", "--idle-timeout", "0")
    server = s.server
    head = b"POST /v1/rocketkv/ask HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
    packed = gzip.compress(b'{"cache": "/x.kv", "questions": ["q"]}')
    cases = [
        (head + b"Content-Encoding: gzip\r\nContent-Length: %d\r\n\r\n" % len(packed) + packed, 415,
         "Content-Encoding 'gzip' is not supported"),
        (head + b"Content-Length: 3\r\nTransfer-Encoding: chunked\r\n\r\n3\r\n{}\n\r\n0\r\n\r\n", 400,
         "Content-Length and Transfer-Encoding both given"),
        (head + b"Content-Encoding: GZIP\r\nContent-Encoding: identity\r\nContent-Length: %d\r\n\r\n" % len(packed)
         + packed, 415, "Content-Encoding 'GZIP' is not supported"),  # every header read, not the last one
    ]  # fmt: skip
    for raw, code, message in cases:
        with socket.create_connection((server.host, server.port), timeout=10) as conn:
            conn.sendall(raw)
            reply = b""
            while chunk := conn.recv(65536):
                reply += chunk
                if b"\r\n\r\n" in reply and reply.rstrip().endswith(b"}"):
                    break
        status, _, rest = reply.partition(b"\r\n")
        body = rest.partition(b"\r\n\r\n")[2]
        assert status.startswith(b"HTTP/1.1 %d" % code), reply
        assert json.loads(body)["error"]["message"] == message, reply
    assert health(server)["status"] == "ok"


def test__a_body_shorter_than_its_content_length__408_and_its_place_in_the_queue_freed(env, served):
    """A client that announces 100 bytes, sends 10 and keeps its socket open: answered 408 (a JSON
    error) once the body timeout passes, instead of holding a place in the queue for good."""
    import socket

    from rocketkv_cli.serve.app import BODY_TIMEOUT_S

    s = served("--host", "127.0.0.1", "--port", "0", "--idle-timeout", "0")
    server = s.server
    with socket.create_connection((server.host, server.port), timeout=BODY_TIMEOUT_S + 30) as conn:
        conn.sendall(b"POST /v1/rocketkv/ask HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 100\r\n\r\n{\"cache\": ")  # fmt: skip
        time.sleep(1)
        assert health(server)["active"] == 1
        t0 = time.monotonic()
        reply = b""
        while b"\r\n\r\n" not in reply or not reply.rstrip().endswith(b"}"):
            chunk = conn.recv(4096)
            if not chunk:
                break
            reply += chunk
    waited = time.monotonic() - t0
    head, _, body = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408"), reply[:300]
    assert "did not arrive" in json.loads(body)["error"]["message"]
    assert BODY_TIMEOUT_S - 5 < waited < BODY_TIMEOUT_S + 20, waited
    assert health(server)["active"] == 0


def test__a_public_host_needs_an_api_key(rocketkv_bin, env):
    r = run(rocketkv_bin, env, "serve", "--host", "0.0.0.0", "--port", "0")
    assert r.returncode == 2 and "--api-key" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.parametrize("action", ["start", "status", "stop"])
def test__a_socket_and_a_port_together__a_usage_error(rocketkv_bin, env, action, tmp_path):
    """`serve --socket S --port N` served on TCP, the socket ignored (and status or stop looked there)."""
    r = run(rocketkv_bin, env, "serve", action, "--socket", str(tmp_path / "s.sock"), "--port", "0")
    assert r.returncode == 2 and "--socket) or on TCP (--host/--port), not both" in r.stderr, r.stderr
    assert r.stderr.count("\n") == 1 and not (tmp_path / "s.sock").exists(), r.stderr


@pytest.mark.parametrize("key", ["ключключключ", "secret\nsecret", " padded-secret "])
def test__an_api_key_no_header_can_carry__refused_by_the_server_and_the_client(rocketkv_bin, env, caches, key):
    """A server started with such a key could never be reached (every client's header refuses it),
    and the client died with "unexpected UnicodeEncodeError": both say so in one line now."""
    r = run(rocketkv_bin, env, "serve", "--port", "0", "--api-key", key)
    assert r.returncode == 2 and "--api-key must be printable ASCII" in r.stderr and "Traceback" not in r.stderr, r
    r = run(rocketkv_bin, {**env, "ROCKETKV_API_KEY": key}, "ask", "--server", "http://127.0.0.1:9", "--cache",
            caches[0], "Who?")  # fmt: skip
    assert (
        r.returncode == 1
        and r.stderr.startswith("Error: ROCKETKV_API_KEY holds characters")
        and r.stderr.count("\n") == 1
    ), r.stderr


def test__a_socket_path_that_names_a_file_is_refused_and_kept(rocketkv_bin, env, tmp_path):
    doc = tmp_path / "doc.kv"
    doc.write_bytes(b"precious")
    r = run(rocketkv_bin, env, "serve", "--socket", doc, "--idle-timeout", "0")
    assert r.returncode == 1 and "is not a socket" in r.stderr and "Traceback" not in r.stderr
    assert doc.read_bytes() == b"precious"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["doc.kv"], "the refusal left a lock file beside it"


def test__concurrent_clients_get_the_in_process_answers(rocketkv_bin, env, caches, served):
    expected = {}
    for q in QUESTIONS:
        r = run(rocketkv_bin, env, "ask", "--cache", caches[0], "--no-server", "--json", q)
        expected[q] = json.loads(r.stdout)["answer"]
    s = served("--idle-timeout", "0", "--max-queue", "64")
    failures: list[str] = []

    def client(k: int) -> None:
        try:
            ask_all(k)
        except Exception as exc:  # a failure in a thread must fail the test
            failures.append(f"client {k}: {exc!r}")

    def ask_all(k: int) -> None:
        for i in range(50):
            q = QUESTIONS[(k + i) % len(QUESTIONS)]
            got = [e for e in events(s.server, "/v1/rocketkv/ask", {"cache": str(caches[0]), "questions": [q]})
                   if e["event"] == "answer"]  # fmt: skip
            if [e["record"]["answer"] for e in got] != [expected[q]]:
                failures.append(f"client {k} question {i}: {got}")

    threads = [threading.Thread(target=client, args=(k,)) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=600)
    assert not failures, failures[:3]
    assert health(s.server)["served"] == 400


def test__a_cache_replaced_on_disk_is_read_again(rocketkv_bin, env, caches, served, tmp_path):
    live = tmp_path / "live.kv"
    live.write_bytes(caches[0].read_bytes())
    served("--idle-timeout", "0")
    first = run(rocketkv_bin, env, "ask", "--cache", live, QUESTIONS[0])
    assert first.returncode == 0
    os.replace(_copy(caches[1], tmp_path / "new.kv"), live)  # as an ingest --force replaces it
    after = run(rocketkv_bin, env, "ask", "--cache", live, QUESTIONS[0])
    fresh = run(rocketkv_bin, env, "ask", "--cache", live, "--no-server", QUESTIONS[0])
    assert after.stdout == fresh.stdout and after.returncode == 0
    old = run(rocketkv_bin, env, "ask", "--cache", caches[0], "--no-server", QUESTIONS[0])
    assert old.stdout == first.stdout  # the first answer was from the first file
    status = run(rocketkv_bin, env, "serve", "status", "--json")
    assert json.loads(status.stdout)["reloads"] == 1
    flag = run(rocketkv_bin, env, "serve", "--status", "--json")  # as other servers spell it
    assert flag.returncode == 0 and json.loads(flag.stdout)["reloads"] == 1, flag.stderr
    both = run(rocketkv_bin, env, "serve", "status", "--stop")
    assert both.returncode == 2 and "give one action: status and stop contradict each other" in both.stderr


def test__the_memory_budget_counts_the_decode_buffers_a_model_keeps(rocketkv_bin, env, caches, served, tmp_path):
    """Answering from a cache makes the model keep decode buffers over it (a float32 copy of its
    keys and values, 4-8x the int8/int4 file): the budget counts them. Within a budget that the
    model and both files fit, but not with those buffers too, asking the second cache evicts the
    first (counting the files alone, both stayed), and the evicted one still answers."""
    sock = tmp_path / "m.sock"
    first = served("--idle-timeout", "0", "--socket", sock)
    assert run(rocketkv_bin, env, "ask", "--cache", caches[0], "--server", first.url, QUESTIONS[0]).returncode == 0
    info = health(first.server)
    buffers, used_a = info["decode_buffers_bytes"], info["used_bytes"]
    assert buffers > 2 * caches[0].stat().st_size  # a float copy of an int-coded file
    status = run(rocketkv_bin, env, "serve", "status", "--socket", sock)
    assert f"{buffers / 1e6:.1f} MB of decode buffers" in status.stdout, status.stdout
    first.stop()
    budget = used_a - buffers + caches[1].stat().st_size + buffers // 2  # fits the model and both files
    s = served("--idle-timeout", "0", "--socket", sock, "--memory-gb", f"{budget / 1e9:.9f}")
    for cache in caches:
        r = run(rocketkv_bin, env, "ask", "--cache", cache, "--server", s.url, QUESTIONS[0])
        assert r.returncode == 0, r.stderr
    info = health(s.server)
    assert info["caches"] == [str(caches[1].resolve())], info
    again = run(rocketkv_bin, env, "ask", "--cache", caches[0], "--server", s.url, QUESTIONS[0])
    local = run(rocketkv_bin, env, "ask", "--cache", caches[0], "--no-server", QUESTIONS[0])
    assert again.returncode == 0 and again.stdout == local.stdout
    assert health(s.server)["caches"] == [str(caches[0].resolve())]


def test__a_model_and_cache_over_the_budget_stay_warm_together(rocketkv_bin, env, caches, served, tmp_path):
    """A budget smaller than one model and one cache (`--memory-gb 0.000001`): the pair used last
    stays warm. Opening the cache evicted the model, and loading the model evicted the cache, so
    every request loaded both again (seconds each)."""
    s = served("--idle-timeout", "0", "--socket", tmp_path / "b.sock", "--memory-gb", "0.000001")
    assert "no idle timeout" in s.stderr_lines[0], s.stderr_lines  # "idle timeout 0s" read as none at all
    for _ in range(3):
        r = run(rocketkv_bin, env, "ask", "--cache", caches[0], "--server", s.url, QUESTIONS[0])
        assert r.returncode == 0, r.stderr
    assert sum("loaded " in line for line in s.stderr_lines) == 1, s.stderr_lines
    info = health(s.server)
    assert info["caches"] == [str(caches[0].resolve())] and len(info["models"]) == 1, info
    r = run(rocketkv_bin, env, "ask", "--cache", caches[0], "--server", s.url, "--dtype", "bfloat16", QUESTIONS[0])
    assert r.returncode == 0, r.stderr
    info = health(s.server)
    (model,) = info["model_descriptions"]  # the float32 one evicted; each named with its dtype too
    assert model.endswith("(bfloat16)") and model.startswith(info["models"][0] + " on cpu"), info


def test__warm__a_spent_budget_evicts_what_the_job_does_not_use(caches, tiny_model_dir):
    """The warm set's choices, with real models and caches (two dtypes of the tiny model: A, B;
    the budget fits A, B and a cache less one byte). A request for (cache b, model A) while A and
    B are warm and B was used last evicts B, not A (A was evicted and loaded again); an ingest on B
    after it drops that cache, not A (the cache was kept over the budget as the last used)."""
    from rocketkv_cli.serve.warm import ModelKey, Warm

    key_a, key_b = (ModelKey(str(tiny_model_dir), "cpu", dtype, None, False) for dtype in ("float32", "bfloat16"))
    probe = Warm(10**12, threads=1)
    probe.model(key_a), probe.model(key_b), probe.cache(caches[1].resolve())
    size_a, size_b = (probe.models[k][1] for k in probe.models)
    warm = Warm(size_a + size_b + probe.caches[caches[1].resolve()].n_bytes - 1, threads=1)
    with warm.job():
        model_a = warm.model(key_a)
    with warm.job():
        warm.model(key_b)
    assert list(warm.models) == [key_a, key_b] and not warm.caches
    with warm.job():  # as `answer_job` opens them: the cache, then the model for it
        stored = warm.cache(caches[1].resolve())
        assert warm.model(key_a, keep_cache=caches[1].resolve()) is model_a  # still warm, not loaded again
    assert list(warm.models) == [key_a] and list(warm.caches) == [caches[1].resolve()] and stored is not None
    with warm.job():  # as `ingest_job` opens its model: no cache
        warm.model(key_b)
    assert list(warm.models) == [key_a, key_b] and not warm.caches


def _copy(src: Path, dst: Path) -> Path:
    dst.write_bytes(src.read_bytes())
    return dst


def test__killed_server_one_line_then_stale_socket_replaced(rocketkv_bin, env, caches, served):
    s = served("--idle-timeout", "0")
    client = subprocess.Popen([rocketkv_bin, "ask", "--cache", str(caches[0]), "--stream", QUESTIONS[0]],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)  # fmt: skip
    deadline = time.monotonic() + 60
    while health(s.server)["active"] == 0 and client.poll() is None and time.monotonic() < deadline:
        time.sleep(0.005)  # until the request is in (the first one loads the model, then decodes)
    s.proc.send_signal(signal.SIGKILL)
    out, err = client.communicate(timeout=120)
    if client.returncode == 0:
        pytest.skip("the answer finished before the kill")  # a fast machine: nothing to observe
    assert client.returncode == 1, err
    assert "Traceback" not in err
    assert [line for line in err.splitlines() if line.startswith("Error:")] == [
        f"Error: the rocketkv server at {s.url} stopped before the answer was complete — run the command again "
        "(with --no-server to answer without it)"
    ]
    sock = Path(env["ROCKETKV_HOME"]) / "serve.sock"
    assert sock.exists()  # left behind by the killed server
    fallback = run(rocketkv_bin, env, "ask", "--cache", caches[0], QUESTIONS[0])
    assert fallback.returncode == 0, fallback.stderr  # a stale socket is no server: answered here
    again = served("--idle-timeout", "0")
    assert again.url == s.url and health(again.server) is not None


def test__ask_right_after_serve_waits_for_the_server_to_start(rocketkv_bin, env, caches, tmp_path):
    """`rocketkv serve &` then `ask` at once (the README's order): the server binds its socket
    before it imports torch, and the ask waits for it (said on stderr) and is answered there; it
    was answered in its own process beside the server's imports (a second torch import on the
    same cores). A second `serve` is refused while the first starts."""
    home = tmp_path / "home"
    environ = {**env, "ROCKETKV_HOME": str(home)}
    proc = subprocess.Popen([rocketkv_bin, "serve", "--idle-timeout", "0"], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, env=environ)  # fmt: skip
    lock = home / "serve.sock.lock"
    try:
        deadline = time.monotonic() + 60
        while not (lock.exists() and lock.read_text() == f"{proc.pid} starting\n"):
            assert proc.poll() is None and time.monotonic() < deadline, "the server did not take its lock"
            time.sleep(0.01)
        asked = run(rocketkv_bin, environ, "ask", "--cache", caches[0], "-v", QUESTIONS[0])
        assert asked.returncode == 0, asked.stderr
        assert f"rocketkv: waiting for the rocketkv server to start (pid {proc.pid})" in asked.stderr, asked.stderr
        assert "answered by the server at unix:" in asked.stderr, asked.stderr
        assert re.search(r"timing: .*waiting for the server to start \d+\.\d\ds, ", asked.stderr), asked.stderr
        assert lock.read_text() == f"{proc.pid} ready\n"
        twice = run(rocketkv_bin, environ, "serve", "--idle-timeout", "0")
        assert twice.returncode == 1 and "already running" in twice.stderr, twice.stderr
        local = run(rocketkv_bin, environ, "ask", "--cache", caches[0], "--no-server", QUESTIONS[0])
        assert asked.stdout == local.stdout
    finally:
        proc.kill()
        proc.wait(timeout=30)


def test__ask_launched_with_serve_in_one_line__waits_for_it(rocketkv_bin, env, caches, tmp_path):
    """`rocketkv serve & rocketkv ask …` on one line: the ask reached its check before the server,
    still importing the CLI, had taken its lock, and answered in its own process (2 runs of 3 for
    a new user). A `rocketkv serve` for the default socket started under 3 s ago (seen in /proc)
    is now waited for to take its lock; one on another socket is not."""
    home = tmp_path / "home"
    environ = {**env, "ROCKETKV_HOME": str(home)}
    elsewhere = subprocess.Popen([rocketkv_bin, "serve", "--socket", str(tmp_path / "other.sock"), "--idle-timeout",
                                  "0"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=environ)  # fmt: skip
    try:
        alone = run(rocketkv_bin, environ, "ask", "--cache", caches[0], "-v", QUESTIONS[0])
        assert alone.returncode == 0 and "waiting for the rocketkv server" not in alone.stderr, alone.stderr
    finally:
        elsewhere.kill()
        elsewhere.wait(timeout=30)
    proc = subprocess.Popen([rocketkv_bin, "serve", "--idle-timeout", "0"], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, env=environ)  # fmt: skip
    try:
        asked = run(rocketkv_bin, environ, "ask", "--cache", caches[0], "-v", QUESTIONS[0])  # no wait between
        assert asked.returncode == 0, asked.stderr
        assert f"rocketkv: waiting for the rocketkv server to start (pid {proc.pid})" in asked.stderr, asked.stderr
        assert asked.stdout == alone.stdout
        assert health(Server(path=str(home / "serve.sock")))["served"] == 1
    finally:
        proc.kill()
        proc.wait(timeout=30)


@pytest.mark.parametrize(
    "argv, serves",
    [
        (["/venv/bin/python3", "/venv/bin/rocketkv", "serve"], True),
        (["/venv/bin/rocketkv", "serve", "--idle-timeout", "0"], True),
        (["python3.11", "-m", "rocketkv_cli", "serve", "start"], True),
        (["/venv/bin/rocketkv", "serve", "--socket", "/tmp/s.sock"], False),
        (["/venv/bin/rocketkv", "serve", "--port=0"], False),
        (["/venv/bin/rocketkv", "serve", "stop"], False),
        (["/venv/bin/rocketkv", "serve", "status", "--json"], False),
        (["man", "rocketkv", "serve"], False),
        (["vim", "rocketkv", "serve"], False),
        (["/venv/bin/rocketkv", "ask", "serve"], False),
    ],
)
def test__launching_server__told_from_its_command_line(argv, serves):
    """Which fresh processes a client waits for to take the default socket (`launching_pid`):
    `rocketkv serve` on the default socket, not on another, not `status`/`stop`, not `man rocketkv
    serve` (an ask beside it waited 3 s for nothing)."""
    from rocketkv_cli.serve.client import _serves_default_socket

    assert _serves_default_socket(argv) == serves


def test__waiting_for_a_launching_server__ends_when_the_lock_names_it(tmp_path):
    """A killed server's lock file ("PID ready") and socket are there before the new server takes
    them: the wait went on to the old ones at once and the ask answered beside the new server."""
    from rocketkv_cli.serve.client import _wait_for_lock

    path = tmp_path / "serve.sock"
    path.with_name("serve.sock.lock").write_text("1 ready\n")  # the killed server's
    path.write_text("")  # and its socket file
    proc = subprocess.Popen(["sleep", "30"])
    try:
        t0 = time.monotonic()
        _wait_for_lock(path, proc.pid, timeout=0.5)
        assert time.monotonic() - t0 >= 0.5  # the old lock names another pid: waited it out
        path.with_name("serve.sock.lock").write_text(f"{proc.pid} starting\n")
        t0 = time.monotonic()
        _wait_for_lock(path, proc.pid, timeout=5)
        assert time.monotonic() - t0 < 1
    finally:
        proc.kill()
        proc.wait()


def test__ask_server_url_right_after_serve_port_waits_for_it_to_start(rocketkv_bin, env, caches, tmp_path):
    """`rocketkv serve --port P &` then `ask --server http://localhost:P` at once: the server
    listens before it imports torch and notes "starting" beside its URL in `tcp-servers/PID`; the
    ask waits for it (it said "no rocketkv server answers" after the 2 s /health time-out)."""
    home = tmp_path / "home"
    environ = {**env, "ROCKETKV_HOME": str(home)}
    proc = subprocess.Popen([rocketkv_bin, "serve", "--port", "0", "--allow-dir", str(caches[0].parent),
                             "--idle-timeout", "0"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env=environ)  # fmt: skip
    listed = home / "tcp-servers" / str(proc.pid)
    try:
        deadline = time.monotonic() + 60
        while not (listed.exists() and listed.read_text().endswith("\nstarting\n")):
            assert proc.poll() is None and time.monotonic() < deadline, "the server did not list itself starting"
            time.sleep(0.01)
        port = listed.read_text().split("\n")[0].rpartition(":")[2]
        asked = run(rocketkv_bin, environ, "ask", "--server", f"http://localhost:{port}", "--cache", caches[0], "-v",
                    QUESTIONS[0])  # fmt: skip
        assert asked.returncode == 0, asked.stderr
        assert f"rocketkv: waiting for the rocketkv server to start (pid {proc.pid})" in asked.stderr, asked.stderr
        assert f"answered by the server at http://localhost:{port}" in asked.stderr, asked.stderr
        local = run(rocketkv_bin, environ, "ask", "--cache", caches[0], "--no-server", QUESTIONS[0])
        assert asked.stdout == local.stdout
        deadline = time.monotonic() + 10
        while not listed.read_text().endswith("\nready\n"):
            assert time.monotonic() < deadline, listed.read_text()
            time.sleep(0.05)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    assert not listed.exists()


def test__a_lock_left_saying_starting_is_not_waited_on(rocketkv_bin, env, caches, tmp_path):
    """A lock file that says "PID starting" for a live process but with no server behind it (a
    server stopped as it started, its pid reused) made every command wait two minutes: with no
    socket, or a socket file nobody listens on, the command answers in its own process."""
    import socket as sockets

    home = tmp_path / "home"
    home.mkdir()
    environ = {**env, "ROCKETKV_HOME": str(home)}
    (home / "serve.sock.lock").write_text(f"{os.getpid()} starting\n")  # this test's process: alive
    local = run(rocketkv_bin, environ, "ask", "--cache", caches[0], "--no-server", QUESTIONS[0])
    for stale_socket in (False, True):
        if stale_socket:  # bound, never listened on: connections are refused
            s = sockets.socket(sockets.AF_UNIX)
            s.bind(str(home / "serve.sock"))
            s.close()
        t0 = time.monotonic()
        r = run(rocketkv_bin, environ, "ask", "--cache", caches[0], QUESTIONS[0])
        assert r.returncode == 0 and r.stdout == local.stdout, r.stderr
        assert time.monotonic() - t0 < 60, "waited on a server that is not there"
        status = run(rocketkv_bin, environ, "serve", "status")
        assert status.returncode == 1 and "no rocketkv server is running" in status.stderr, status.stderr


def test__status_stop_and_idle_timeout(rocketkv_bin, env, served, tmp_path):
    none = run(rocketkv_bin, env, "serve", "status")
    assert none.returncode == 1 and "no rocketkv server is running" in none.stderr
    assert none.stderr.rstrip().endswith("start one with `rocketkv serve`"), none.stderr
    # the hint starts the server the status asked about, not the default one
    elsewhere = run(rocketkv_bin, env, "serve", "status", "--socket", tmp_path / "my s.sock")
    assert elsewhere.returncode == 1 and elsewhere.stderr.rstrip().endswith(
        f"start one with `rocketkv serve --socket '{tmp_path / 'my s.sock'}'`"), elsewhere.stderr  # fmt: skip
    s = served("--idle-timeout", "0")
    status = run(rocketkv_bin, env, "serve", "status")
    assert status.returncode == 0 and f"pid {s.proc.pid}" in status.stdout
    twice = run(rocketkv_bin, env, "serve", "--idle-timeout", "0")
    assert twice.returncode == 1 and "already running" in twice.stderr
    assert "see `rocketkv serve status`, or stop it with `rocketkv serve stop`" in twice.stderr, twice.stderr
    # a server on another socket: the hint names that socket (the default's commands would miss it)
    mine = tmp_path / "my s.sock"
    other = served("--socket", mine, "--idle-timeout", "0")
    again = run(rocketkv_bin, env, "serve", "--socket", mine, "--idle-timeout", "0")
    named = f"--socket '{mine}'"
    assert again.returncode == 1 and f"`rocketkv serve status {named}`, or stop it with `rocketkv serve stop {named}`" \
        in again.stderr, again.stderr  # fmt: skip
    other.stop()
    stop = run(rocketkv_bin, env, "serve", "stop")
    assert stop.returncode == 0, stop.stderr
    assert s.proc.wait(timeout=30) == 0
    assert not (Path(env["ROCKETKV_HOME"]) / "serve.sock").exists()
    assert (Path(env["ROCKETKV_HOME"]) / "serve.sock.lock").read_text() == ""  # no "starting" left to wait on
    time.sleep(0.2)  # the reader thread takes the last lines
    assert any("stopped (shutdown request)" in line for line in s.stderr_lines), s.stderr_lines
    idle = served("--idle-timeout", "1")
    assert idle.proc.wait(timeout=60) == 0
    time.sleep(0.2)
    assert any("idle for 1s" in line for line in idle.stderr_lines)
    assert any("stopped (idle for 1s)" in line for line in idle.stderr_lines), idle.stderr_lines


def test__status_and_stop_without_port_name_a_running_tcp_server(rocketkv_bin, env, served):
    """`rocketkv serve --port P` then `serve status` / `serve stop` (the socket's): they said no
    server runs, nothing more; they name the TCP server and how to reach it."""
    s = served("--host", "127.0.0.1", "--port", "0", "--idle-timeout", "0")
    port = s.url.rsplit(":", 1)[1]
    for action in ("status", "stop"):
        r = run(rocketkv_bin, env, "serve", action)
        assert r.returncode == 1, r.stderr
        assert f"— one runs on {s.url}: name it with --port {port}" in r.stderr, r.stderr
    stop = run(rocketkv_bin, env, "serve", "stop", "--port", port)
    assert stop.returncode == 0, stop.stderr
    assert s.proc.wait(timeout=30) == 0
    assert not (Path(env["ROCKETKV_HOME"]) / "tcp-servers" / str(s.proc.pid)).exists()  # its note removed
    r = run(rocketkv_bin, env, "serve", "status")
    assert r.returncode == 1 and "one runs on" not in r.stderr, r.stderr


def test__ctrl_c_in_a_terminal_and_sigterm_in_a_pipe_stop_the_server_cleanly(rocketkv_bin, env, served, tmp_path):
    """Ctrl-C (a foreground server in a terminal) and SIGTERM (a service manager) are how a server
    is stopped: one "stopped" line, exit 0, its socket removed; not "Error: interrupted"."""
    import pty
    import select

    sock = tmp_path / "c.sock"
    pid, fd = pty.fork()
    if pid == 0:  # the child: `rocketkv serve` on the terminal
        try:
            signal.signal(signal.SIGINT, signal.SIG_DFL)  # as a shell's foreground job (CI may run us with it ignored)
            os.execve(rocketkv_bin, [rocketkv_bin, "serve", "--socket", str(sock), "--idle-timeout", "0"],
                      {**env, "TERM": "xterm-256color"})  # fmt: skip
        finally:
            os._exit(127)  # never back into pytest
    shown, deadline = b"", time.monotonic() + 120
    while b"serving on" not in shown and time.monotonic() < deadline:
        if select.select([fd], [], [], 0.2)[0]:
            shown += os.read(fd, 4096)
    os.write(fd, b"\x03")  # Ctrl-C typed: the terminal echoes "^C" and sends SIGINT to the foreground job
    while time.monotonic() < deadline:
        if select.select([fd], [], [], 0.2)[0]:
            try:
                chunk = os.read(fd, 4096)
            except OSError:  # the terminal closed with the child
                break
            if not chunk:
                break
            shown += chunk
    done, status = os.waitpid(pid, os.WNOHANG)
    while done == 0 and time.monotonic() < deadline + 30:
        time.sleep(0.1)
        done, status = os.waitpid(pid, os.WNOHANG)
    if done == 0:  # still running: never leave it behind
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        raise AssertionError(f"the server did not stop on SIGINT: {shown[-2000:]!r}")
    code = os.waitstatus_to_exitcode(status)
    screen = strip_ansi(shown.decode(errors="replace"))
    assert code == 0 and "stopped (interrupted)" in screen and "Error" not in screen, (code, screen)
    assert "^Crocketkv: stopped" not in screen, screen  # its line begins after the echoed ^C
    assert not sock.exists()
    s = served("--idle-timeout", "0", "--socket", tmp_path / "t.sock")
    s.proc.send_signal(signal.SIGTERM)
    assert s.proc.wait(timeout=60) == 0
    time.sleep(0.2)  # the reader thread takes the last lines
    assert any("stopped (SIGTERM)" in line for line in s.stderr_lines), s.stderr_lines
    assert not (tmp_path / "t.sock").exists()


def test__ask_through_the_server_in_a_terminal(rocketkv_bin, env, caches, served):
    local = run(rocketkv_bin, env, "ask", "--cache", caches[0], "--no-server", QUESTIONS[0])
    served("--idle-timeout", "0")
    code, shown = run_in_terminal([rocketkv_bin, "ask", "--cache", str(caches[0]), QUESTIONS[0]], env)
    assert code == 0, shown
    text = strip_ansi(shown).replace("\r\n", "\n")
    assert local.stdout.strip() in text and "Traceback" not in text
    assert "in the server" in text.split("loaded ")[0], text  # the spinner while the server loaded the model
    # a long question (three chunks): its reading is shown, here and through the server, and answered alike
    long = "Which letters come first? " + text_of_bytes(2600, seed=3)
    argv = [rocketkv_bin, "ask", "--cache", str(caches[0]), "--max-new-tokens", "4", long]
    shown_here = strip_ansi(run_in_terminal([*argv[:-1], "--no-server", long], env)[1]).replace("\r\n", "\n")
    shown_there = strip_ansi(run_in_terminal(argv, env)[1]).replace("\r\n", "\n")
    assert re.search(r"reading the question .*/2,6\d\d tokens", shown_here), shown_here[-1500:]
    assert "reading the question in the server: " in shown_there, shown_there[-1500:]
    answer_of = lambda shown: shown.rstrip().splitlines()[-2]  # noqa: E731 - the line above "answered in …"
    assert answer_of(shown_here) == answer_of(shown_there), (shown_here[-500:], shown_there[-500:])


def test__chat_from_a_pipe_uses_the_server_with_the_same_output(rocketkv_bin, env, caches, served):
    questions = "\n".join(QUESTIONS[:3]) + "\n"
    local = run(rocketkv_bin, env, "chat", "--cache", caches[0], "--no-server", stdin=questions)
    local_bad = run(rocketkv_bin, env, "chat", "--cache", caches[0], "--no-server", "--segment", "3", stdin="q\n")
    s = served("--idle-timeout", "0")
    remote = run(rocketkv_bin, env, "chat", "--cache", caches[0], stdin=questions)
    assert remote.returncode == local.returncode == 0, remote.stderr
    assert "(in the server)" in remote.stderr, remote.stderr  # the model loaded for it is said, as ask says it
    assert remote.stdout == local.stdout and local.stdout.count("Q: ") == 3
    bad = run(rocketkv_bin, env, "chat", "--cache", caches[0], "--segment", "3", stdin="q\n")
    assert (bad.returncode, bad.stdout) == (local_bad.returncode, local_bad.stdout) and bad.returncode == 1
    errors = [line for line in bad.stderr.splitlines() if line.startswith("Error:")]
    assert errors == [line for line in local_bad.stderr.splitlines() if line.startswith("Error:")], bad.stderr
    assert health(s.server)["served"] == 5  # remote: 1 check + 3 questions, then the refused check


def test__chat_goes_on_in_its_own_process_once_the_server_is_gone(rocketkv_bin, env, caches, served):
    """A chat through a server whose idle timeout passed while the prompt waited (or that was
    stopped) answered every later question with "cannot reach the rocketkv server" until it was
    restarted. The question is asked in the chat's own process instead, said once on stderr; the
    answers are those of a chat without the server."""
    local = run(rocketkv_bin, env, "chat", "--cache", caches[0], "--no-server", "--json",
                stdin=QUESTIONS[0] + "\n" + QUESTIONS[1] + "\n")  # fmt: skip
    s = served("--idle-timeout", "0")
    chat = subprocess.Popen([rocketkv_bin, "chat", "--cache", str(caches[0]), "--json"], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)  # fmt: skip
    try:
        chat.stdin.write(QUESTIONS[0] + "\n")
        chat.stdin.flush()
        first = chat.stdout.readline()  # answered by the server
        assert health(s.server)["served"] >= 2  # the chat's check and its first question
        s.proc.terminate()  # the server goes away while the prompt waits (as its idle timeout would end it)
        assert s.proc.wait(timeout=60) == 0
        chat.stdin.write(QUESTIONS[1] + "\n")
        chat.stdin.flush()
        rest, errors = chat.communicate(timeout=300)  # closes stdin: the chat ends after this question
    finally:
        chat.kill()
    drop = lambda out: [{k: v for k, v in json.loads(x).items() if not k.endswith("_s")} for x in out.splitlines()]
    assert chat.returncode == 0, errors
    assert drop(first + rest) == drop(local.stdout) and len(drop(local.stdout)) == 2
    assert errors.count("is gone (stopped, or its idle timeout passed): answering in this process") == 1, errors


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP])
def test__a_server_stopped_mid_answer__tells_its_client_and_logs_no_traceback(rocketkv_bin, env, caches, served,
                                                                              tmp_path, signum):  # fmt: skip
    """SIGTERM (or SIGHUP: its terminal closed) while an answer streams: the answer ends at once
    with one line for the client (exit 1) and the server stops with its one "stopped" line, exit 0:
    uvicorn's graceful shutdown used to wait 3 s, then cancel the response mid-stream (a 60-line
    traceback in the server's log); a hangup, which uvicorn does not handle, was raised inside the
    event loop (a traceback, the clients cut off)."""
    questions = tmp_path / "q.txt"
    questions.write_text("".join(f"What is item {i}?\n" for i in range(900)))  # far more work than 3 s
    s = served("--idle-timeout", "0", "--socket", tmp_path / "s.sock")
    argv = [rocketkv_bin, "ask", "--cache", str(caches[0]), "--questions-file", str(questions), "--max-new-tokens",
            "64", "--server", s.url]  # fmt: skip
    client = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    waiting = None
    try:
        for _ in range(4):  # answers are streaming from the server
            assert client.stdout.readline(), client.stderr.read()
        waiting = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        deadline = time.monotonic() + 60
        while health(s.server)["active"] < 2 and time.monotonic() < deadline:  # its request waits for its turn
            time.sleep(0.05)
        s.proc.send_signal(signum)
        outs = [p.communicate(timeout=60) for p in (client, waiting)]
    finally:
        for p in (client, waiting):
            if p is not None:
                p.kill()
    for p, (_, err) in zip((client, waiting), outs):  # the one answering and the one waiting: not retried
        errors = [line for line in err.splitlines() if line.startswith("Error:")]
        assert p.returncode == 1 and errors and "stopped before the answer was complete" in errors[0], err
        assert "Traceback" not in err
    assert s.proc.wait(timeout=60) == 0
    time.sleep(0.2)  # the reader thread takes the last lines
    log = "".join(s.stderr_lines)
    assert f"stopped ({signal.Signals(signum).name})" in log and "Traceback" not in log and "ERROR" not in log, log


def test__a_cache_whose_name_is_not_utf8__answered_and_the_server_stays_healthy(rocketkv_bin, env, caches, served,
                                                                                tmp_path):  # fmt: skip
    """A file name that is not UTF-8 (Latin-1 `café.kv`) reached the server as a lone surrogate:
    encoding the response failed mid-stream, and once the cache was warm /health failed for good,
    so `serve status` and `serve stop` said no server was running while it held the socket."""
    odd = Path(os.fsdecode(bytes(tmp_path) + b"/caf\xe9.kv"))
    odd.write_bytes(caches[0].read_bytes())
    s = served("--idle-timeout", "0", "--socket", tmp_path / "s.sock")

    def run_odd(*args):  # the output names the file: bytes that are not UTF-8
        return subprocess.run([rocketkv_bin, *map(str, args)], capture_output=True, text=True, env=env, timeout=300,
                              errors="surrogateescape")  # fmt: skip

    here = run_odd("ask", "--cache", odd, QUESTIONS[0], "--no-server")
    there = run_odd("ask", "--cache", odd, QUESTIONS[0], "--server", s.url)
    assert there.returncode == 0 and there.stdout == here.stdout, there.stderr
    assert health(s.server)["caches"] == [str(odd)]  # JSON, read back as the name the server holds
    status = run_odd("serve", "status", "--socket", tmp_path / "s.sock")
    assert status.returncode == 0 and "running: pid" in status.stdout, status.stdout + status.stderr
    assert "Traceback" not in "".join(s.stderr_lines)
    # a line break or an ESC in a warm cache's name: `serve status` keeps its caches on one line, escaped
    tricky = tmp_path / "two\nlines\x1b[31m.kv"
    tricky.write_bytes(caches[0].read_bytes())
    assert run_odd("ask", "--cache", tricky, QUESTIONS[0], "--server", s.url).returncode == 0
    status = run_odd("serve", "status", "--socket", tmp_path / "s.sock")
    listed = [line for line in status.stdout.splitlines() if line.startswith("caches: ")]
    assert len(listed) == 1 and "two\\nlines\\x1b[31m.kv" in listed[0] and "\x1b" not in status.stdout, status.stdout


def _send(server: Server, path: str, body: dict, timeout: float = 300):
    """The request sent, its response not read yet (the server answers once the work has started)."""
    conn = server.connection(timeout)
    conn.request("POST", path, body=json.dumps(body).encode(), headers=server.headers())
    return conn


def _post(server: Server, path: str, body: dict, timeout: float = 300):
    conn = _send(server, path, body, timeout)
    return conn, conn.getresponse()


def test__ingest_endpoint_streams_progress_and_writes_the_file(rocketkv_bin, env, tiny_model_dir, served, tmp_path):
    doc = tmp_path / "doc.txt"
    doc.write_text(text_of_bytes(900, seed=3) + "\nThe secret code is 5151.\n")
    s = served("--host", "127.0.0.1", "--port", "0", "--allow-dir", tmp_path, "--allow-dir", tiny_model_dir,
               "--idle-timeout", "0")  # fmt: skip
    conn, response = _post(s.server, "/v1/ingest", {"document": str(doc), "output": str(tmp_path / "d.kv"),
                                                     "model": str(tiny_model_dir), "token_budget": 64})  # fmt: skip
    assert response.status == 200 and response.getheader("content-type").startswith("text/event-stream")
    frames = [json.loads(line.removeprefix("data: ")) for line in response.read().decode().splitlines()
              if line.startswith("data: ")]  # fmt: skip
    conn.close()
    assert frames[-1]["event"] == "written" and frames[-1]["bytes"] == (tmp_path / "d.kv").stat().st_size
    progress = [f for f in frames if f["event"] == "progress"]
    assert progress and progress[-1]["done"] >= 900
    inspect = run(rocketkv_bin, env, "inspect", tmp_path / "d.kv", "--json")
    assert inspect.returncode == 0 and json.loads(inspect.stdout)["n_context_tokens"] >= 900
    conn, refused = _post(s.server, "/v1/ingest", {"document": str(doc), "output": "/tmp/outside-allowed.kv"})
    assert refused.status == 403 and "outside" in json.loads(refused.read())["error"]["message"]
    conn, again = _post(s.server, "/v1/ingest", {"document": str(doc), "output": str(tmp_path / "d.kv"),
                                                  "model": str(tiny_model_dir)})  # fmt: skip
    assert again.status == 409 and '"force": true' in json.loads(again.read())["error"]["hint"]  # not replaced
    precious = tmp_path / "precious.txt"
    precious.write_text("not a cache")
    (tmp_path / "trap.kv").symlink_to(precious)
    conn, trap = _post(s.server, "/v1/ingest", {"document": str(doc), "output": str(tmp_path / "trap.kv"),
                                                 "force": True, "model": str(tiny_model_dir)})  # fmt: skip
    assert trap.status == 400 and "not a .kv file" in json.loads(trap.read())["error"]["message"]
    assert precious.read_text() == "not a cache"  # the link's target is kept
    conn, missing = _post(
        s.server, "/v1/ingest", {"document": str(tmp_path / "nope.txt"), "output": str(tmp_path / "n.kv")}
    )
    assert missing.status == 400 and "document not found" in json.loads(missing.read())["error"]["message"]
    fifo = tmp_path / "fifo.txt"
    os.mkfifo(fifo)
    conn, fifo_doc = _post(s.server, "/v1/ingest", {"document": str(fifo), "output": str(tmp_path / "f.kv")})
    assert fifo_doc.status == 400 and "not a regular file" in json.loads(fifo_doc.read())["error"]["message"]
    assert health(s.server)["status"] == "ok" and health(s.server)["active"] == 0  # nothing left waiting


def test__a_full_queue_gets_503_and_a_client_that_leaves_cancels(env, caches, served):
    s = served("--idle-timeout", "0", "--max-queue", "2")  # one answered, one waiting: a third is refused
    many = {"cache": str(caches[0]), "questions": QUESTIONS * 10}
    first = _send(s.server, "/v1/rocketkv/ask", many)  # answering (holds the decode lock) ...
    second = _send(s.server, "/v1/rocketkv/ask", many)  # ... and waiting behind it
    deadline = time.monotonic() + 60
    while health(s.server)["active"] < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    conn, busy = _post(s.server, "/v1/rocketkv/ask", {"cache": str(caches[0]), "questions": ["q"]})
    assert busy.status == 503 and busy.getheader("retry-after") == "1"
    assert json.loads(busy.read())["error"]["message"].startswith("the server is busy")
    second.close()  # the waiting client goes away: its request must not be answered
    first.getresponse().read()
    first.close()
    deadline = time.monotonic() + 120
    while (health(s.server)["active"] > 0 or health(s.server)["cancelled"] < 1) and time.monotonic() < deadline:
        time.sleep(0.05)
    info = health(s.server)
    assert info["cancelled"] == 1 and info["active"] == 0, info


@pytest.mark.parametrize("extra", [[], ["--extractive"]], ids=["model", "extractive"])
def test__summarize_uses_the_server_with_the_same_output(rocketkv_bin, env, caches, served, extra):
    local = run(rocketkv_bin, env, "summarize", "--cache", caches[0], "--no-server", "--json", *extra)
    assert local.returncode == 0, local.stderr
    s = served("--idle-timeout", "0")
    remote = run(rocketkv_bin, env, "summarize", "--cache", caches[0], "--json", *extra)
    assert remote.returncode == 0, remote.stderr
    assert "(in the server)" in remote.stderr, remote.stderr  # the model loaded for it is said, as ask says it
    drop = lambda out: {k: v for k, v in json.loads(out).items() if k != "summarize_s"}  # noqa: E731
    assert drop(remote.stdout) == drop(local.stdout)
    text = run(rocketkv_bin, env, "summarize", "--cache", caches[0], *extra)
    text_local = run(rocketkv_bin, env, "summarize", "--cache", caches[0], "--no-server", *extra)
    assert text.stdout == text_local.stdout and text.returncode == 0
    assert health(s.server)["served"] == 2
    conn = s.server.connection(120)  # a client that shows status events (the CLI's spinner) is told it summarizes
    body = {"cache": str(caches[0]), "extractive": "--extractive" in extra}
    conn.request("POST", "/v1/rocketkv/summarize", body=json.dumps(body),
                 headers={"Content-Type": "application/json", "X-RocketKV-Events": "status"})  # fmt: skip
    said = [json.loads(line) for line in conn.getresponse()]
    assert {"event": "status", "message": "summarizing in the server"} in said, said


def test__compile_step__the_server_decodes_through_the_captured_step(rocketkv_bin, env, caches, served):
    """`serve --compile-step`: the warm model decodes through the compiled step (counted in
    /health), and its greedy answers are the in-process ones (the eager step's)."""
    local = run(rocketkv_bin, env, "ask", "--cache", caches[0], "--no-server", *QUESTIONS)
    assert local.returncode == 0, local.stderr
    s = served("--idle-timeout", "0", "--compile-step")
    remote = run(rocketkv_bin, env, "ask", "--cache", caches[0], *QUESTIONS)
    assert remote.returncode == 0, remote.stderr
    assert remote.stdout == local.stdout
    info = health(s.server)
    assert info["compile_step"] is True and info["captured_steps"] > 0 and info["compile_failure"] is None, info
    status = run(rocketkv_bin, env, "serve", "status")
    assert f"decode step: compiled, {info['captured_steps']:,} steps captured\n" in status.stdout, status.stdout
    assert any("first answer compiles its decode step" in line for line in s.stderr_lines), s.stderr_lines


def test__a_long_question__its_reading_and_a_wait_are_status_events(env, caches, served):
    """A question prefilled in chunks tells a client that shows status events (the CLI: a spinner)
    how far the server has read it, and a request waiting behind it says it waits; the job checks
    between chunks whether its client left. Both were silent: the second client of two waited
    with nothing on its screen."""
    import http.client

    s = served("--host", "127.0.0.1", "--port", "0", "--idle-timeout", "0", "--allow-dir", caches[0].parent)
    server = s.server

    def post(questions: list[str], max_new_tokens: int):
        conn = http.client.HTTPConnection(server.host, server.port, timeout=120)
        body = {"cache": str(caches[0]), "questions": questions, "max_new_tokens": max_new_tokens}
        conn.request("POST", "/v1/rocketkv/ask", body=json.dumps(body),
                     headers={"Content-Type": "application/json", "X-RocketKV-Events": "status"})  # fmt: skip
        return conn.getresponse()

    long = "Which letters come first? " + text_of_bytes(2600, seed=3)  # ~2,600 ids: three chunks
    first = post([long], 200)
    statuses = []
    for line in first:
        event = json.loads(line)
        assert event["event"] == "status", event
        statuses.append(event["message"])
        break  # the model is loading for it: the decode lock is held
    second = post(["Which letter?"], 4)
    waited = json.loads(second.readline())
    assert waited == {"event": "status", "message": "waiting: the server is busy with another request"}, waited
    rest = [json.loads(line) for line in first]
    statuses += [e["message"] for e in rest if e["event"] == "status"]
    assert statuses[0].startswith("loading "), statuses  # the model, in the server (under the decode lock)
    found = [re.fullmatch(r"reading the question in the server: ([\d,]+) of ([\d,]+) tokens", m) for m in statuses[1:]]
    assert all(found) and len(found) >= 4, statuses
    done = [int(m[1].replace(",", "")) for m in found if m]
    total = {int(m[2].replace(",", "")) for m in found if m}
    assert done[0] == 0 and done == sorted(done) and len(total) == 1 and done[-1] in total, statuses
    assert rest[-1]["event"] == "done" and any(e["event"] == "answer" for e in rest), rest[-3:]
    second_events = [json.loads(line) for line in second]
    turn = re.fullmatch(r"working on this request in the server \(after waiting [\d.]+ s\)",
                        second_events[0].get("message", ""))  # fmt: skip
    assert second_events[0]["event"] == "status" and turn, second_events[:2]  # the wait's end: said
    assert [e["event"] for e in second_events][-2:] == ["answer", "done"]
    # a client that does not ask for status events gets none of them
    plain = http.client.HTTPConnection(server.host, server.port, timeout=120)
    plain.request("POST", "/v1/rocketkv/ask", body=json.dumps({"cache": str(caches[0]), "questions": [long],
                  "max_new_tokens": 2}), headers={"Content-Type": "application/json"})  # fmt: skip
    events_plain = [json.loads(line) for line in plain.getresponse()]
    assert "status" not in {e.get("event") for e in events_plain}, events_plain[:3]


def test__job_reading__a_job_whose_client_left_stops_between_chunks():
    """`Job.reading` is the long question's per-chunk callback in the server: once the client has
    gone (`cancelled`), the next chunk raises Cancelled (the job ends, its decoder reset), not
    after the whole question has been read (minutes, with the decode lock held)."""
    import asyncio

    from rocketkv_cli.serve.jobs import Cancelled, Job

    loop = asyncio.new_event_loop()
    try:
        job = Job(loop)
        job.reading(1024, 4096)  # a client still there: nothing raised, no event (it did not ask for status)
        loop.run_until_complete(asyncio.sleep(0))  # what the job handed over reaches the queue
        assert job.queue.empty()
        job.announce = True
        job.reading(1024, 4096)
        loop.run_until_complete(asyncio.sleep(0))
        assert job.queue.get_nowait() == {"event": "status", "message": "reading the question in the server: "
                                                                        "1,024 of 4,096 tokens"}  # fmt: skip
        job.cancelled.set()
        with pytest.raises(Cancelled):
            job.reading(2048, 4096)
    finally:
        loop.close()


def test__job_waiting__a_long_wait_is_said_on_the_clients_stderr():
    """The answer's "answered in N s" leaves out a wait behind another request in the server (a
    busy server looked fast): a wait of a second or more is a `log` event (the CLI prints it),
    to a client that asked for status events only; a short one is a status event alone."""
    import asyncio

    from rocketkv_cli.serve.jobs import Job

    loop = asyncio.new_event_loop()

    def events(job: Job) -> list[dict]:
        loop.run_until_complete(asyncio.sleep(0))
        out = []
        while not job.queue.empty():
            out.append(job.queue.get_nowait())
        return out

    try:
        plain = Job(loop)
        plain.waiting(None)
        plain.waiting(12.34)
        assert events(plain) == []
        job = Job(loop)
        job.announce = True
        job.waiting(0.4)
        assert events(job) == [{"event": "status", "message": "working on this request in the server (after waiting "
                                                              "0.4 s)"}]  # fmt: skip
        job.waiting(12.34)
        assert events(job)[1:] == [{"event": "log", "message": "waited 12.3 s in the server behind another request"}]
    finally:
        loop.close()


def test__a_model_path_is_sent_to_the_server_absolute(tmp_path, monkeypatch):
    """`ask --model ./dir` through a server: the server takes only absolute model paths (a relative
    one would be read from its own folder), so the client sends the path it means; presets and hub
    ids go as they are."""
    from rocketkv_cli.cli.remote import model_for_server
    from rocketkv_cli.cli.sources import ModelChoice

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "my-model").mkdir()
    sent = lambda model: model_for_server(ModelChoice(model, "auto", None, None, False).for_server())["model"]
    assert sent("~/my-model") == str(tmp_path / "my-model")
    assert sent("my-model") == sent("./my-model") == str(tmp_path / "my-model")
    assert sent("gemma-3-270m") == "gemma-3-270m" and sent("org/name") == "org/name" and sent(None) is None


def test__serve_json__prints_where_it_serves_and_its_stop_command_names_the_port(rocketkv_bin, env, tmp_path):
    """`serve --port 0 --json` printed nothing on stdout (the chosen port was only in stderr's
    prose), and its line said `stop with rocketkv serve stop`, which looks at the default socket."""
    environ = {**env, "ROCKETKV_HOME": str(tmp_path / "home")}
    proc = subprocess.Popen([rocketkv_bin, "serve", "--port", "0", "--json", "--idle-timeout", "0"], text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=environ)  # fmt: skip
    try:
        assert select.select([proc.stdout], [], [], 120)[0], "nothing on stdout"
        event = json.loads(proc.stdout.readline())
        assert event["event"] == "serving" and event["pid"] == proc.pid and event["url"].startswith("http://127.0.0.1:")
        port = event["url"].rpartition(":")[2]
        assert health(parse_url(event["url"])) is not None
        stopped = run(rocketkv_bin, environ, "serve", "stop", "--port", port, "--json")
        assert stopped.returncode == 0 and json.loads(stopped.stdout) == {"event": "stopped", "url": event["url"]}
        assert proc.wait(timeout=30) == 0
        assert f"stop with `rocketkv serve stop --port {port}`" in proc.stderr.read()
    finally:
        proc.kill()


def test__a_connection_that_never_finishes_its_headers_is_closed(served, caches):
    """A client that sends part of a request's headers, then a byte now and then (slowloris), held
    its connection open for ever: 20,000 of them took every file descriptor and no request could be
    answered. A connection whose headers are not all there 10 s after it opened, or after its last
    response (a kept-alive connection), is closed; whole requests are served as before."""
    import socket as sockets

    from rocketkv_cli.serve.server import HEADERS_TIMEOUT_S

    s = served("--host", "127.0.0.1", "--port", "0", "--idle-timeout", "0", "--allow-dir", caches[0].parent)
    for first_a_whole_request in (False, True):
        slow = sockets.create_connection((s.server.host, s.server.port), timeout=HEADERS_TIMEOUT_S + 20)
        if first_a_whole_request:
            slow.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
            got = b""
            while b'"status"' not in got:
                got += slow.recv(4096)
        t0 = time.monotonic()
        slow.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ")
        closed = False
        while time.monotonic() - t0 < HEADERS_TIMEOUT_S + 15:
            try:
                slow.sendall(b"a")  # a byte every second: uvicorn's keep-alive timer restarted at each
                slow.settimeout(1.0)
                if slow.recv(1024) == b"":
                    closed = True
                    break
            except TimeoutError:
                continue
            except OSError:  # reset by the server
                closed = True
                break
        slow.close()
        took = time.monotonic() - t0
        assert closed and took < HEADERS_TIMEOUT_S + 10, (first_a_whole_request, took)
    assert health(s.server) is not None  # and the server serves whole requests


def test__a_tcp_listing_left_saying_starting_is_not_waited_on(rocketkv_bin, env, caches, tmp_path):
    """A `tcp-servers/PID` file left saying "starting" for a live pid (a server killed as it
    started, its pid reused) with nothing listening on the port made `--server URL` wait two
    minutes: a refused connection ends the wait, and the client says no server answers."""
    import socket as sockets

    home = tmp_path / "home"
    (home / "tcp-servers").mkdir(parents=True)
    probe = sockets.socket()
    probe.bind(("127.0.0.1", 0))
    port = probe.getsockname()[1]
    probe.close()  # a port nobody listens on
    (home / "tcp-servers" / str(os.getpid())).write_text(f"http://127.0.0.1:{port}\nstarting\n")  # this test: alive
    t0 = time.monotonic()
    r = run(rocketkv_bin, {**env, "ROCKETKV_HOME": str(home)}, "ask", "--server", f"http://127.0.0.1:{port}",
            "--cache", caches[0], QUESTIONS[0])  # fmt: skip
    assert r.returncode == 1 and f"no rocketkv server answers at http://127.0.0.1:{port}" in r.stderr, r.stderr
    assert time.monotonic() - t0 < 30, "waited on a server that is not there"


def test__batch_with_a_missing_manifest__says_only_that_with_a_server_running(rocketkv_bin, env, served, tmp_path):
    """`rocketkv batch nope.jsonl` with a server running said "rows run by the server at …" before
    "manifest not found": the manifest is checked first now."""
    served("--idle-timeout", "0")
    r = run(rocketkv_bin, env, "batch", tmp_path / "nope.jsonl")
    assert r.returncode == 1 and r.stderr == f"Error: manifest not found: {tmp_path / 'nope.jsonl'} — check the path\n"


def test__threads_note_only_where_the_server_computes_with_other_threads(rocketkv_bin, env, caches, served):
    """`ask --threads N` through a server started with `--threads N` says nothing of threads (the
    server computes with N, always); with another N it notes that the server's own count is used."""
    cache = caches[0]
    s = served("--threads", "1", "--idle-timeout", "0")
    info = health(s.server)
    assert info["threads"] == 1 and info["threads_fixed"] is True, info
    same = run(rocketkv_bin, env, "ask", "--cache", cache, "--threads", "1", QUESTIONS[0])
    assert same.returncode == 0 and "--threads" not in same.stderr, same.stderr
    other = run(rocketkv_bin, env, "ask", "--cache", cache, "--threads", "2", QUESTIONS[0])
    assert other.returncode == 0 and other.stdout == same.stdout, other.stderr
    assert f"note: --threads 2 is not used: the server at {s.url} computes with its own threads (1 now)" in other.stderr


def test__questions_over_the_servers_body_limit__answered_in_process(rocketkv_bin, env, caches, served, tmp_path):
    """A questions file whose request is over the server's body limit (1 MiB) failed with "request
    body over 1048576 bytes"; it is answered in the client's own process, as with --no-server (the
    same stdout, stderr and exit code), and /health says the limit."""
    cache = caches[0]
    s = served("--idle-timeout", "0")
    assert health(s.server)["max_body_bytes"] == 1 << 20
    questions = tmp_path / "questions.txt"
    questions.write_text(f"{QUESTIONS[0]}\n{'What does the river say? ' * 48_000}\n")  # 1.2 MB, 2 questions
    through = run(rocketkv_bin, env, "ask", "--cache", cache, "--questions-file", questions, "--json")
    here = run(rocketkv_bin, env, "ask", "--cache", cache, "--questions-file", questions, "--json", "--no-server")
    assert "request body" not in through.stderr, through.stderr
    said = f"rocketkv: the questions are over the request limit of the server at {s.url}: answered in this process"
    assert said in through.stderr.splitlines(), through.stderr
    # what the server path adds: that line, and a wait for a server still starting (a loaded machine)
    waited = "rocketkv: waiting for the rocketkv server"
    ours = lambda text: [re.sub(r" in \d+\.\ds", "", line) for line in text.splitlines()  # noqa: E731 (load time)
                         if line != said and not line.startswith(waited)]  # fmt: skip
    assert (through.returncode, ours(through.stderr)) == (here.returncode, ours(here.stderr))
    assert without_timings(through.stdout) == without_timings(here.stdout)


def test__a_request_over_the_body_limit__does_not_fit__and_batch_runs_it_here(env, served, tmp_path, tiny_model_dir,
                                                                              monkeypatch):  # fmt: skip
    """`fits` asks the server's limit for a large request; a batch through a server whose
    `remote` returns None for a task (its row over the limit: a text of a megabyte and more) runs
    that task in its own process: the same result lines as a batch without a server. (A real row
    that large takes minutes to prefill on the tiny model; the in-process path is what it adds.)"""
    from rocketkv_cli.batch.run import run_batch
    from rocketkv_cli.batch.tasks import BatchSettings
    from rocketkv_cli.core.config import PrefillConfig
    from rocketkv_cli.serve.client import fits

    s = served("--idle-timeout", "0")
    assert fits(s.server, {"text": "x" * 500_000})
    assert not fits(s.server, {"text": "x" * (1 << 20)}) and not fits(s.server, {"text": "é" * 180_000})
    monkeypatch.setenv("ROCKETKV_HOME", env["ROCKETKV_HOME"])
    manifest = tmp_path / "rows.jsonl"
    rows = [{"id": i, "text": text_of_bytes(600, seed=i), "questions": [QUESTIONS[0]]} for i in range(2)]
    manifest.write_text("".join(json.dumps(r) + "\n" for r in rows))
    settings = BatchSettings(model=str(tiny_model_dir), config=PrefillConfig(token_budget=64), threads=1)
    results = {}
    for name, remote in (("here", None), ("none", lambda task: None)):
        run_batch(manifest, tmp_path / f"{name}.jsonl", tmp_path / f"caches-{name}", settings, remote=remote)
        results[name] = [{k: v for k, v in json.loads(line).items() if k not in ("elapsed_s", "cache", *TIMING_KEYS)}
                         for line in (tmp_path / f"{name}.jsonl").read_text().splitlines()]  # fmt: skip
    assert len(results["here"]) == 2 and all("answer" in r for r in results["here"]), results["here"]
    assert results["none"] == results["here"]


class _Broken(http.server.BaseHTTPRequestHandler):
    """A server that says it is rocketkv (`/health`) and answers an ask with `self.server.stream`:
    a damaged or foreign stream, which rocketkv's own server never sends."""

    def do_GET(self):
        self._reply(json.dumps({"service": "rocketkv", "status": "ok", "version": "0"}).encode())

    def do_POST(self):
        self.rfile.read(int(self.headers["Content-Length"]))
        self._reply(self.server.stream)

    def _reply(self, body: bytes):
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.mark.parametrize("stream", [
    b'{"event": "done"}\n',  # no answer at all: printed nothing and exited 0
    b'{"event": "answer", "record": null}\n{"event": "done"}\n',  # a TypeError's traceback
    b'{"event": "answer", "record": {"answer": 7}}\n{"event": "done"}\n',
    b'["event", "done"]\n',  # JSON, not an event object
])  # fmt: skip
def test__a_server_that_sends_no_answer_or_a_damaged_one__one_line_exit_1(rocketkv_bin, env, caches, stream):
    """A server (or a proxy) whose stream ends with `done` but no answer, or whose answer record is
    not one, made `ask` exit 0 with nothing printed, or crash; now one line and exit 1."""
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Broken)
    httpd.stream = stream
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{httpd.server_address[1]}"
        r = run(rocketkv_bin, env, "ask", "--server", url, "--cache", caches[0], QUESTIONS[0])
    finally:
        httpd.shutdown()
    assert r.returncode == 1 and r.stdout == "", (r.returncode, r.stdout, r.stderr)
    lines = r.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"Error: the server at {url} "), r.stderr
