"""Bad input, damaged caches, failing writes and interruptions: one table of cases for the installed CLI.

Used by `tests/test_reliability.py` (asserts each case) and `scripts/reliability_report.py`
(writes `docs/reliability.md` from the same runs), so the document cannot drift from the tests.
"""

from __future__ import annotations

import json
import os
import resource
import shlex
import shutil
import signal
import struct
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

ROCKETKV = str(Path(sys.executable).parent / "rocketkv")
QUESTION = "What is the code?"


@dataclass
class Workspace:
    """A directory with a tiny model (`model/`), a document (`doc.txt`) and its cache (`doc.kv`)."""

    root: Path
    env: dict[str, str]

    @property
    def model(self) -> Path:
        return self.root / "model"

    @property
    def doc(self) -> Path:
        return self.root / "doc.txt"

    @property
    def kv(self) -> Path:
        return self.root / "doc.kv"

    def file(self, name: str, data: bytes) -> Path:
        path = self.root / name
        path.write_bytes(data)
        return path

    def copy_kv(self, name: str) -> Path:
        path = self.root / name
        shutil.copyfile(self.kv, path)
        return path


def make_workspace(root: Path, save_model: Callable[[Path], None], document: str) -> Workspace:
    """Create the workspace: `save_model(dir)` writes a model directory; the cache is built by the CLI."""
    root.mkdir(parents=True, exist_ok=True)
    home = root / "home"
    home.mkdir(exist_ok=True)
    env = {**os.environ, "ROCKETKV_HOME": str(home), "HF_HUB_OFFLINE": "1", "COLUMNS": "200"}
    ws = Workspace(root=root, env=env)
    save_model(ws.model)
    ws.doc.write_text(document)
    r = subprocess.run([ROCKETKV, "ingest", ws.doc, "-o", ws.kv, "--model", ws.model, "--budget", "64",
                        "--max-new-tokens", "6", "-q"], capture_output=True, text=True, env=env)  # fmt: skip
    if r.returncode != 0:
        raise RuntimeError(f"workspace ingest failed: {r.stderr}")
    return ws


@dataclass
class Case:
    """One bad situation: the command, what must come back, and what must still hold afterwards."""

    name: str
    group: str
    args: Callable[[Workspace], list]
    code: int
    message: str  # substring of the one "Error:" line ("" when the command must succeed)
    stdin: str | None = None
    drop_dac: bool = False  # run without root's permission override (unreadable / read-only cases)
    file_size_limit: int | None = None  # RLIMIT_FSIZE in bytes: writes fail half-way
    send_signal: int | None = None  # sent once the model is loaded (or after `signal_after_s`)
    signal_after_s: float | None = None  # send the signal this long after the start (start-up, imports)
    check: Callable[[Workspace], None] | None = None
    notes: str = ""
    before_model: bool = False  # the failure must come before the model loads (no "loaded" line)
    log_has: str = ""  # substring stderr must contain (a hint or report line)
    close_stdout: bool = False  # run with descriptor 1 closed (`>&-`)
    shell: Callable[[Workspace], str] | None = None  # a bash command line instead of `args` (`<(…)`)
    during: Callable[[Workspace], None] | None = None  # done to the files once the model is loaded
    or_error: str = ""  # with code 0: exit 1 with this message is right too (a change caught in time)
    same_answer_as: Callable[[Workspace], list] | None = None  # args of a command whose answer must be equal


@dataclass
class Outcome:
    command: str
    code: int
    error_line: str
    stdout: str
    stderr: str
    extra: dict = field(default_factory=dict)


def _cmd(ws: Workspace, case: Case) -> list[str]:
    argv = ["bash", "-c", case.shell(ws)] if case.shell else [ROCKETKV, *map(str, case.args(ws))]
    if case.drop_dac and os.geteuid() == 0:
        argv = ["setpriv", "--bounding-set", "-dac_override,-dac_read_search", "--", *argv]
    return argv


def default_sigint() -> None:
    """In the child: Ctrl-C handled normally even when the tests run as a background job (which
    starts with SIGINT ignored, and so would its children), and a hangup too under `nohup` (which
    ignores SIGHUP)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.signal(signal.SIGHUP, signal.SIG_DFL)


def startup_seconds() -> float:
    """How long this machine takes, right now, to start Python and import rocketkv's entry module
    (a signal sent earlier reaches the interpreter's own start-up, which no program can handle)."""
    t0 = time.monotonic()
    subprocess.run([sys.executable, "-c", "import rocketkv_cli"], check=True)
    return time.monotonic() - t0


def run_case(ws: Workspace, case: Case) -> Outcome:
    """Run one case's command in a subprocess and collect what it printed."""
    argv = _cmd(ws, case)

    def limits():
        if case.file_size_limit is not None:
            resource.setrlimit(resource.RLIMIT_FSIZE, (case.file_size_limit, case.file_size_limit))
        if case.close_stdout:
            os.close(1)

    if case.send_signal is None and case.during is None:
        r = subprocess.run(argv, stdout=None if case.close_stdout else subprocess.PIPE, stderr=subprocess.PIPE,
                           text=True, env=ws.env, input=case.stdin, preexec_fn=limits, timeout=300)  # fmt: skip
        out, errs, code = r.stdout or "", r.stderr, r.returncode
    elif case.signal_after_s is not None:  # during start-up: the delay counts from after Python's own start
        delay = case.signal_after_s + 2 * startup_seconds()
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ws.env,
                                stdin=subprocess.DEVNULL, preexec_fn=default_sigint)  # fmt: skip
        time.sleep(delay)
        proc.send_signal(case.send_signal)
        out, errs = proc.communicate(timeout=120)
        code = proc.returncode
    else:
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ws.env,
                                stdin=subprocess.DEVNULL, preexec_fn=default_sigint)  # fmt: skip
        lines = []
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:  # wait until the model is loaded and work has begun
            line = proc.stderr.readline()
            lines.append(line)
            if not line or "loaded" in line:
                break
        if case.during is not None:
            case.during(ws)
        else:
            time.sleep(0.5)
            proc.send_signal(case.send_signal)
        out, rest = proc.communicate(timeout=120)
        errs, code = "".join(lines) + rest, proc.returncode
    errors = [line for line in errs.splitlines() if line.startswith("Error:")]
    usage = [line.strip(" │") for line in errs.splitlines() if "Invalid value" in line or "No such option" in line]
    if code == 2 and usage:
        errors = usage

    def show(a: str) -> str:
        if len(a) > 60:
            return json.dumps(a[:24] + f"…({len(a)} chars)", ensure_ascii=False)
        return json.dumps(a, ensure_ascii=False) if (" " in a or not a) else a

    shown = " ".join(show(a) for a in argv if a not in ("setpriv",))
    if case.shell:
        shown = argv[-1]
    shown = shown.replace(str(ws.root) + "/", "").replace(ROCKETKV, "rocketkv")
    if case.drop_dac and os.geteuid() == 0:
        shown = shown.replace("--bounding-set -dac_override,-dac_read_search -- ", "")
    if case.close_stdout:
        shown += " >&-"
    return Outcome(command=shown, code=code, error_line=errors[0] if errors else "", stdout=out, stderr=errs)


def problems(ws: Workspace, case: Case, out: Outcome) -> list[str]:
    """What is wrong with a case's outcome (empty: as expected). The test asserts this is empty;
    the report prints it. `case.check` runs last (it may change the workspace)."""
    code, message = case.code, case.message
    if case.or_error and out.code == 1:  # a change caught in time: the other right outcome
        code, message = 1, case.or_error
    found = []
    if out.code != code:
        found.append(f"exit {out.code}, expected {code}")
    if "Traceback" in out.stderr:
        found.append("a traceback")
    if code in (1, 130, 143):
        errors = [line for line in out.stderr.splitlines() if line.startswith("Error:")]
        if len(errors) != 1:
            found.append(f"{len(errors)} Error: lines")
        if message not in out.error_line:
            found.append(f"message lacks {message!r}")
    if code == 1 and out.stdout:
        found.append("a failure printed results")
    if case.before_model and "rocketkv: loaded" in out.stderr:
        found.append("refused only after the model loaded")
    if case.log_has and case.log_has not in out.stderr:
        found.append(f"stderr lacks {case.log_has!r}")
    if out.code == 0 and case.same_answer_as is not None:
        reference = run_case(ws, Case("reference", "", case.same_answer_as, 0, ""))
        if out.stdout != reference.stdout:
            found.append(f"answered {out.stdout!r}, the intact file answers {reference.stdout!r}")
    if case.check is not None:
        try:
            case.check(ws)
        except Exception as exc:  # an AssertionError, or the check could not even read what it checks
            found.append(f"check failed: {exc}")
    return found


# ---- helpers that build damaged caches -------------------------------------------------------


def _header(path: Path) -> tuple[int, dict, bytes]:
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    return n, json.loads(data[8 : 8 + n]), data


def _write_header(path: Path, header: dict, payload: bytes, redigest: bool = True) -> Path:
    from rocketkv_cli.store.format import metadata_digest

    if redigest:
        header["__metadata__"]["metadata_sha256"] = metadata_digest(header["__metadata__"])
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + payload)
    return path


def truncated(ws: Workspace, fraction: float) -> Path:
    path = ws.copy_kv(f"trunc{int(fraction * 100)}.kv")
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * fraction)])
    return path


def flipped(ws: Workspace) -> Path:
    path = ws.copy_kv("flipped.kv")
    data = bytearray(path.read_bytes())
    data[len(data) - 100] ^= 0x01
    path.write_bytes(bytes(data))
    return path


def edited(ws: Workspace, name: str, **meta) -> Path:
    path = ws.copy_kv(name)
    n, header, data = _header(path)
    header["__metadata__"].update(meta)
    return _write_header(path, header, data[8 + n :])


def page_over_topk(ws: Workspace) -> Path:
    """Every budgets record of the file with a page larger than its top-k (metadata re-digested)."""
    path = ws.copy_kv("page.kv")
    n, header, data = _header(path)
    meta = header["__metadata__"]
    budgets = json.loads(meta["budgets"])
    budgets["page_size"] = 100_000_000
    meta["budgets"] = json.dumps(budgets)
    segments = json.loads(meta["segments"])
    for segment in segments:
        segment["budgets"]["page_size"] = 100_000_000
    meta["segments"] = json.dumps(segments)
    return _write_header(path, header, data[8 + n :])


def enormous(ws: Workspace) -> Path:
    path = ws.copy_kv("enormous.kv")
    n, header, data = _header(path)
    name = next(k for k in ("segments.0.layers.0.keys", "segments.0.layers.0.keys.q") if k in header)  # float or int
    header[name]["shape"] = [1 << 20, 1 << 20, 1 << 12]
    return _write_header(path, header, data[8 + n :])


def foreign_safetensors(ws: Workspace) -> Path:
    import torch
    from safetensors.torch import save_file

    path = ws.root / "weights.kv"
    save_file({"embed.weight": torch.zeros(4, 4)}, str(path))
    return path


def other_model(ws: Workspace) -> Path:
    import torch
    from conftest import byte_tokenizer, tiny_model

    path = ws.root / "other-model"
    if not path.exists():
        tiny_model("llama", torch.float32, seed=7).save_pretrained(path)
        byte_tokenizer().save_pretrained(path)
    return path


def other_tokenizer(ws: Workspace) -> Path:
    """Same weights as the workspace model, tokenizer with one extra special token."""
    from conftest import byte_tokenizer

    path = ws.root / "other-tokenizer"
    if not path.exists():
        shutil.copytree(ws.model, path)
        tok = byte_tokenizer()
        tok.add_special_tokens({"additional_special_tokens": ["<extra>"]})
        tok.save_pretrained(path)
    return path


def no_weights(ws: Workspace) -> Path:
    path = ws.root / "no-weights"
    path.mkdir(exist_ok=True)
    shutil.copyfile(ws.model / "config.json", path / "config.json")
    return path


def unsupported(ws: Workspace) -> Path:
    path = ws.root / "gpt2-model"
    path.mkdir(exist_ok=True)
    (path / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_layer": 1}))
    (path / "model.safetensors").write_bytes(b"")
    return path


def unreadable(ws: Workspace) -> Path:
    path = ws.file("secret.txt", b"a readable document, were it not for its mode")
    path.chmod(0)
    return path


def fifo(ws: Workspace) -> Path:
    path = ws.root / "pipe.kv"
    if not path.exists():
        os.mkfifo(path)
    return path


def _is_fifo(ws: Workspace) -> None:
    import stat

    assert stat.S_ISFIFO((ws.root / "pipe.kv").stat().st_mode), "the FIFO was replaced"


def _dev_stdout_kept(ws: Workspace) -> None:
    assert os.path.islink("/dev/stdout"), "/dev/stdout was replaced"


def read_only_dir(ws: Workspace) -> Path:
    path = ws.root / "ro"
    path.mkdir(exist_ok=True)
    path.chmod(0o555)
    return path / "out.kv"


def symlink_target(ws: Workspace) -> Path:
    victim = ws.file("victim.txt", b"precious")
    link = ws.root / "link.kv"
    if link.is_symlink() or link.exists():
        link.unlink()
    link.symlink_to(victim)
    return link


def existing_target(ws: Workspace) -> Path:
    path = ws.file("existing.kv", b"old contents")
    return path


# ---- checks -----------------------------------------------------------------------------------


def no_temp_files(ws: Workspace) -> None:
    stray = [p.name for p in ws.root.rglob("*.tmp")]
    assert not stray, f"temporary files left behind: {stray}"


def _untouched(name: str, content: bytes) -> Callable[[Workspace], None]:
    def check(ws: Workspace) -> None:
        assert (ws.root / name).read_bytes() == content, f"{name} was modified"
        no_temp_files(ws)

    return check


def _symlink_check(ws: Workspace) -> None:
    assert (ws.root / "victim.txt").read_bytes() == b"precious", "wrote through the symlink"


def _full_cache_check(ws: Workspace) -> None:
    from rocketkv_cli.store.format import load_cache

    stored = load_cache(ws.root / "big-budget.kv")
    assert all(layer.n_kept_tokens == stored.n_context_tokens for layer in stored.layers), "pruned despite big budget"
    (ws.root / "big-budget.kv").rename(ws.root / "big-budget-keep.kv")


def _segmented_check(ws: Workspace) -> None:
    from rocketkv_cli.store.format import SegmentedKVCache, load_cache

    stored = load_cache(ws.root / "h.kv")
    assert isinstance(stored, SegmentedKVCache) and len(stored.segments) == 2, type(stored)
    assert not (ws.root / ".h.kv.segments").exists(), "checkpoints left behind"


def _no_partial_then(name: str) -> Callable[[Workspace], None]:
    def check(ws: Workspace) -> None:
        assert not (ws.root / name).exists(), f"partial file {name} left behind"
        no_temp_files(ws)

    return check


# ---- issue 17: start-up, junk left by kill -9, pre-flight checks, default names ----------------


def _short_kept_whole(ws: Workspace) -> None:
    from rocketkv_cli.store.format import load_cache

    stored = load_cache(ws.root / "short.kv")
    kept = {layer.n_kept_tokens for layer in stored.layers}
    assert kept == {stored.n_context_tokens}, f"kept {kept} of {stored.n_context_tokens} tokens"


def _kept_at_least_budget(ws: Workspace) -> None:
    from rocketkv_cli.store.format import load_cache

    stored = load_cache(ws.root / "over.kv")
    kept = {layer.n_kept_tokens for layer in stored.layers}
    assert stored.n_context_tokens > 64 and kept == {64}, f"kept {kept} of {stored.n_context_tokens} tokens"


def killed_mid_write(ws: Workspace) -> Path:
    """A real SIGKILL during the final write: a process writes a cache into `junk/` and kills
    itself (signal 9) half-way through writing the temporary file. Returns the output for the
    next ingest into that directory. Also planted: a 0.1.0-style temp file (no pid in its name)
    untouched for two days, and files that must survive (a young 0.1.0-style temp file, which
    could belong to a running 0.1.0 ingest, and a user's own `.rocketkv-notes.txt`)."""
    junk = ws.root / "junk"
    junk.mkdir(exist_ok=True)
    code = ("import os, sys; from pathlib import Path; from rocketkv_cli.store.atomic import atomic_write; "
            "atomic_write(Path(sys.argv[1]), True, lambda out: (out.write(b'x' * 4096), out.flush(), "
            "os.kill(os.getpid(), 9)))")  # fmt: skip
    r = subprocess.run([sys.executable, "-c", code, str(junk / "killed.kv")], env=ws.env)
    assert r.returncode == -9, r
    assert [p for p in junk.glob(".rocketkv-*.tmp")], "the killed write left no temp file to clean"
    old = junk / ".rocketkv-k3j4h5g6.tmp"
    old.write_bytes(b"left by a killed 0.1.0 ingest")
    os.utime(old, (time.time() - 2 * 86400, time.time() - 2 * 86400))
    (junk / ".rocketkv-young123.tmp").write_bytes(b"maybe a running 0.1.0 ingest's")
    (junk / ".rocketkv-notes.txt").write_bytes(b"not rocketkv's")
    return junk / "clean.kv"


def _junk_cleaned(ws: Workspace) -> None:
    junk = ws.root / "junk"
    names = sorted(p.name for p in junk.iterdir())
    shutil.rmtree(junk)  # whatever the outcome: the other cases' checks want a workspace without *.tmp
    assert names == [".rocketkv-notes.txt", ".rocketkv-young123.tmp", "clean.kv"], names


def killed_segmented_ingest(ws: Workspace) -> Path:
    """An ingest in segments killed with SIGKILL after its first checkpoint (`ab/`): it leaves
    `.ab.kv.segments/` behind. Returns the directory."""
    folder = ws.root / "ab"
    folder.mkdir(exist_ok=True)
    if (folder / ".ab.kv.segments").exists():
        return folder
    doc = ws.file("ab.txt", ("word " * 12 + "\n").encode() * 40)
    proc = subprocess.Popen([ROCKETKV, "ingest", doc, "-o", folder / "ab.kv", "--segment-tokens", "200", "--model",
                             ws.model], stderr=subprocess.PIPE, text=True, env=ws.env)  # fmt: skip
    for line in proc.stderr:
        if "segment 1:" in line:
            proc.kill()
            break
    proc.wait(timeout=120)
    assert (folder / ".ab.kv.segments").is_dir(), "the killed ingest left no checkpoints"
    for stray in folder.rglob("*.tmp"):  # temp files are the subject of another case
        stray.unlink()
    return folder


def _ab_cache(ws: Workspace) -> Path:
    folder = killed_segmented_ingest(ws)
    target = folder / "other.kv"
    if not target.exists():
        subprocess.run([ROCKETKV, "ingest", ws.doc, "-o", target, "--model", ws.model, "-q"], env=ws.env, check=True,
                       stdout=subprocess.DEVNULL)  # fmt: skip
    return target


def _no_file(name: str) -> Callable[[Workspace], None]:
    def check(ws: Workspace) -> None:
        assert not (ws.root / name).exists(), f"{name} was written"
        no_temp_files(ws)

    return check


def _default_names(ws: Workspace) -> None:
    from rocketkv_cli.store.format import read_metadata

    txt, md = ws.root / "notes.txt.kv", ws.root / "notes.md.kv"
    assert txt.is_file() and md.is_file(), sorted(p.name for p in ws.root.glob("notes*"))
    assert read_metadata(txt)["document_source"].endswith("notes.txt"), "notes.md replaced the cache of notes.txt"
    assert read_metadata(md)["document_source"].endswith("notes.md")


def _notes_txt(ws: Workspace) -> Path:
    doc = ws.file("notes.txt", b"Notes in text. The code is 11.\n" * 8)
    subprocess.run([ROCKETKV, "ingest", doc, "--model", ws.model, "-q", "--force"], env=ws.env, check=True,
                   stdout=subprocess.DEVNULL)  # fmt: skip
    return ws.file("notes.md", b"# Notes in Markdown\n\nThe code is 22.\n" * 8)


def unreadable_cache(ws: Workspace) -> Path:
    path = ws.root / "locked.kv"
    if not path.exists():
        ws.copy_kv("locked.kv").chmod(0)
    return path


def cache_directory(ws: Workspace) -> Path:
    path = ws.root / "dir.kv"
    path.mkdir(exist_ok=True)
    return path


def overwrite_in_place(name: str) -> Callable[[Workspace], None]:
    """`dd if=/dev/zero of=FILE seek=… conv=notrunc`: a quarter of the file zeroed in place, from
    its middle (as `cp` or `rsync --inplace` onto an existing cache would change it)."""

    def act(ws: Workspace) -> None:
        path = ws.root / name
        size = path.stat().st_size
        with open(path, "r+b") as f:
            f.seek(size // 2)
            f.write(bytes(size // 4))
            f.flush()
            os.fsync(f.fileno())

    return act


def truncate_in_place(name: str) -> Callable[[Workspace], None]:
    def act(ws: Workspace) -> None:
        os.truncate(ws.root / name, 9184)  # the size the reproduction used

    return act


def _fresh(ws: Workspace, name: str) -> Path:
    return ws.copy_kv(name)


def _segmented_copy(ws: Workspace, name: str) -> Path:
    """A copy of a cache of doc.txt ingested in segments (read lazily, segment by segment)."""
    source = ws.root / "segmented-source.kv"
    if not source.exists():
        subprocess.run([ROCKETKV, "ingest", ws.doc, "-o", source, "--segment-tokens", "200", "--model", ws.model, "-q"],
                       env=ws.env, check=True, stdout=subprocess.DEVNULL)  # fmt: skip
    path = ws.root / name
    shutil.copyfile(source, path)
    return path


M = lambda ws: ["--model", ws.model]  # noqa: E731
Q = lambda text: shlex.quote(str(text))  # noqa: E731

CASES: list[Case] = [
    # input documents
    Case("missing document", "input", lambda ws: ["ingest", ws.root / "nope.txt", *M(ws)], 1, "not found"),
    Case("missing document with [markup] in its name", "input", lambda ws: ["ingest", ws.root / "notes[x][bold].txt", *M(ws)], 1, "notes[x][bold].txt"),
    Case("a directory", "input", lambda ws: ["ingest", ws.root / "home", "-o", ws.root / "d.kv", *M(ws)], 1, "is a directory"),
    Case("empty file", "input", lambda ws: ["ingest", ws.file("empty.txt", b""), *M(ws)], 1, "is empty"),
    Case("whitespace only", "input", lambda ws: ["ingest", ws.file("ws.txt", b" \n\t \n"), *M(ws)], 1, "whitespace only"),
    Case("binary file (NUL bytes)", "input", lambda ws: ["ingest", ws.file("bin.txt", b"\x01\x02data\x00\x00"), *M(ws)], 1, "looks binary"),
    Case("Latin-1 text", "input", lambda ws: ["ingest", ws.file("latin1.txt", "Café crème, s'il vous plaît".encode("latin-1")), *M(ws)], 1, "not valid utf-8"),
    Case("Latin-1 text with --encoding latin-1", "input", lambda ws: ["ingest", ws.file("latin1ok.txt", ("Café crème. " * 30).encode("latin-1")), "-o", ws.root / "latin1-keep.kv", "--encoding", "latin-1", *M(ws)], 0, "", notes="decodes and ingests"),
    Case("UTF-16 text", "input", lambda ws: ["ingest", ws.file("utf16.txt", "hello there".encode("utf-16")), *M(ws)], 1, "--encoding utf-16"),
    Case("unreadable permissions", "input", lambda ws: ["ingest", unreadable(ws), *M(ws)], 1, "no permission", drop_dac=True),
    Case("document longer than the context", "input", lambda ws: ["ingest", ws.file("huge.txt", b"word " * 1000), "-o", ws.root / "h.kv", *M(ws)], 0, "", check=_segmented_check, notes="ingested in 2 segments"),
    Case("--segment-tokens too small for the framing", "options", lambda ws: ["ingest", ws.doc, "-o", ws.root / "s.kv", "--segment-tokens", "64", *M(ws)], 1, "no room for text"),
    Case("--segment-tokens over the context", "options", lambda ws: ["ingest", ws.doc, "-o", ws.root / "s.kv", "--segment-tokens", "100000", *M(ws)], 1, "more than this model's context fits"),
    Case("--segment on a one-segment cache", "questions", lambda ws: ["ask", "--cache", ws.kv, "--segment", "3", QUESTION], 1, "one segment"),
    Case("$ROCKETKV_HOME is a file", "input", lambda ws: [], 1, "is not a directory", shell=lambda ws: f"ROCKETKV_HOME={Q(ws.doc)} {Q(ROCKETKV)} models", notes="was an unexpected NotADirectoryError"),
    Case("- with stdin closed", "input", lambda ws: [], 1, "(stdin) is empty", shell=lambda ws: f"{Q(ROCKETKV)} ingest - -o {Q(ws.root / 'closed-in.kv')} --model {Q(ws.model)} <&-", before_model=True, check=_no_file("closed-in.kv"), notes="read as empty, as < /dev/null (it was an AttributeError)"),
    Case("--questions-file - with stdin closed", "input", lambda ws: [], 1, "no question", shell=lambda ws: f"{Q(ROCKETKV)} ask --cache {Q(ws.kv)} --questions-file - --no-server <&-", before_model=True),
    Case("- with empty stdin", "input", lambda ws: ["ingest", "-", "-o", ws.root / "stdin.kv", *M(ws)], 1, "(stdin) is empty", stdin="", before_model=True),
    Case("summarize an empty device", "input", lambda ws: ["summarize", "/dev/null", *M(ws)], 1, "/dev/null is empty", before_model=True),
    # options
    Case("budget 0", "options", lambda ws: ["ingest", ws.doc, "-o", ws.root / "b.kv", "--budget", "0", *M(ws)], 2, "--budget must be a positive integer", notes="usage error: exit 2"),
    Case("negative budget", "options", lambda ws: ["ingest", ws.doc, "-o", ws.root / "b.kv", "--budget", "-5", *M(ws)], 2, "--budget must be a positive integer", notes="usage error: exit 2"),
    Case("non-integer budget", "options", lambda ws: ["ingest", ws.doc, "--budget", "lots", *M(ws)], 2, "", notes="usage error: Typer's message, exit 2"),
    Case("budget larger than the document", "options", lambda ws: ["ingest", ws.doc, "-o", ws.root / "big-budget.kv", "--budget", "100000", *M(ws)], 0, "", check=_full_cache_check, notes="keeps every token: full attention"),
    Case("--max-new-tokens 0", "options", lambda ws: ["ask", "--cache", ws.kv, QUESTION, "--max-new-tokens", "0"], 2, "", notes="usage error: Typer's range check, exit 2"),
    Case("ask --page-size larger than topk", "options", lambda ws: ["ask", "--cache", ws.kv, QUESTION, "--page-size", "100000000"], 1, "--page-size", notes="the cache's own topk bounds it: exit 1"),
    Case("ask --topk 0", "options", lambda ws: ["ask", "--cache", ws.kv, QUESTION, "--topk", "0"], 2, "--topk", before_model=True, notes="usage error: Typer's range check, exit 2"),
    Case("--errors surrogateescape (a Python handler that gives no text)", "options", lambda ws: ["ingest", ws.doc, "-o", ws.root / "e2.kv", "--errors", "surrogateescape", *M(ws)], 2, "--errors", before_model=True, notes="was accepted, then failed in the tokenizer after the model loaded"),
    Case("unknown --errors handler", "options", lambda ws: ["ingest", ws.doc, "-o", ws.root / "e.kv", "--errors", "shrug", *M(ws)], 2, "--errors", notes="usage error: exit 2"),
    Case("prompt budget below the window", "options", lambda ws: ["ingest", ws.doc, "-o", ws.root / "w.kv", "--budget", "2", "--max-new-tokens", "600", *M(ws)], 2, "below the observation window", before_model=True, notes="usage error: exit 2, before the model loads"),
    Case("short document at a small budget", "options", lambda ws: ["ingest", ws.file("short.txt", b"The cat is Tom.\n"), "-o", ws.root / "short.kv", "--budget", "64", *M(ws)], 0, "", check=_short_kept_whole, notes="a document that fits the budget is kept whole"),
    Case("document a little longer than the budget", "options", lambda ws: ["ingest", ws.file("over.txt", b"The cat sat on the mat all day. Its name is Tom; the dog is Rex.\n"), "-o", ws.root / "over.kv", "--budget", "64", *M(ws)], 0, "", check=_kept_at_least_budget, notes="keeps the 64 tokens the budget allows, never fewer"),
    Case("unknown model name", "options", lambda ws: ["ingest", ws.doc, "-o", ws.root / "m.kv", "--model", "no-such-model"], 1, "unknown model"),
    Case("model directory without weights", "options", lambda ws: ["ingest", ws.doc, "-o", ws.root / "m.kv", "--model", no_weights(ws)], 1, "no *.safetensors"),
    Case("$ROCKETKV_KERNELS misspelt", "options", lambda ws: [], 2, "ROCKETKV_KERNELS must be one of auto, torch, triton", shell=lambda ws: f"ROCKETKV_KERNELS=cuda {Q(ROCKETKV)} ask --cache {Q(ws.kv)} {Q(QUESTION)} --no-server", before_model=True, notes="was an 'unexpected ValueError' after the model loaded"),
    Case("ROCKETKV_KERNELS=triton on a CPU", "options", lambda ws: [], 2, "ROCKETKV_KERNELS=triton runs on a CUDA device", shell=lambda ws: f"env -u TRITON_INTERPRET ROCKETKV_KERNELS=triton {Q(ROCKETKV)} ask --cache {Q(ws.kv)} {Q(QUESTION)} --no-server", notes="was an 'unexpected ValueError' from the first kernel"),
    Case("--server unix: (no socket file named)", "options", lambda ws: ["ask", "--server", "unix:", "--cache", ws.kv, QUESTION], 2, "names no file", before_model=True, notes="was an 'unexpected ValueError'; serve --socket '' and / too"),
    Case("a .gguf model that is no GGUF", "options", lambda ws: ["ingest", ws.doc, "-o", ws.root / "m.kv", "--model", ws.file("junk.gguf", b"not a model")], 1, "is not a GGUF file"),
    Case("unsupported architecture", "options", lambda ws: ["ingest", ws.doc, "-o", ws.root / "m.kv", "--model", unsupported(ws)], 1, "unsupported architecture"),
    Case("--device cuda without a GPU", "options", lambda ws: ["ingest", ws.doc, "-o", ws.root / "c.kv", "--device", "cuda", *M(ws)], 1, "no CUDA GPU"),
    # outputs
    Case("-o into a missing directory", "outputs", lambda ws: ["ingest", ws.doc, "-o", ws.root / "no" / "x.kv", *M(ws)], 1, "does not exist"),
    Case("-o into a read-only directory", "outputs", lambda ws: ["ingest", ws.doc, "-o", read_only_dir(ws), *M(ws)], 1, "cannot write", drop_dac=True, check=_no_partial_then("ro/out.kv"), before_model=True),
    Case("-o newdir/ (a directory that does not exist)", "outputs", lambda ws: ["ingest", ws.doc, "-o", f"{ws.root / 'newdir'}/", *M(ws)], 1, "names a directory", check=_no_file("newdir"), before_model=True),
    Case("process substitution without -o", "outputs", lambda ws: [], 2, "pass -o", shell=lambda ws: f"{Q(ROCKETKV)} ingest <(cat {Q(ws.doc)}) --model {Q(ws.model)}", before_model=True, notes="a pipe has no name to derive the output from"),
    Case("default output name keeps the document's suffix", "outputs", lambda ws: ["ingest", _notes_txt(ws), "--force", *M(ws)], 0, "", check=_default_names, notes="notes.txt → notes.txt.kv, notes.md → notes.md.kv: neither replaces the other"),
    Case("ingest --json with stdout closed", "outputs", lambda ws: ["ingest", ws.doc, "-o", ws.root / "closed.kv", "--json", *M(ws)], 1, "stdout is closed", close_stdout=True, before_model=True, check=_no_file("closed.kv")),
    Case("stale temp file of a write killed by SIGKILL", "outputs", lambda ws: ["ingest", ws.doc, "-o", killed_mid_write(ws), *M(ws)], 0, "", check=_junk_cleaned, notes="the next ingest into the directory removes it (its pid is dead); a 0.1.0 temp file goes once 24 h old"),
    Case("checkpoints of an ingest killed by SIGKILL (ingest)", "outputs", lambda ws: ["ingest", ws.doc, "-o", killed_segmented_ingest(ws) / "next.kv", *M(ws)], 0, "", log_has="rm -r", notes="reported with how to resume or remove them"),
    Case("target exists (no --force)", "outputs", lambda ws: ["ingest", ws.doc, "-o", existing_target(ws), *M(ws)], 1, "already exists", check=_untouched("existing.kv", b"old contents")),
    Case("target is a symlink (no --force)", "outputs", lambda ws: ["ingest", ws.doc, "-o", symlink_target(ws), *M(ws)], 1, "already exists", check=_symlink_check),
    Case("target is a symlink (--force)", "outputs", lambda ws: ["ingest", ws.doc, "-o", symlink_target(ws), "--force", *M(ws)], 0, "", check=_symlink_check, notes="the link is replaced by the new file; its target is untouched"),
    Case("write fails half-way (file size limit)", "outputs", lambda ws: ["ingest", ws.doc, "-o", existing_target(ws), "--force", *M(ws)], 1, "cannot write", file_size_limit=10_000, check=_untouched("existing.kv", b"old contents")),
    Case("-o the document itself (--force)", "outputs", lambda ws: ["ingest", ws.file("self.txt", b"some words " * 40), "-o", ws.root / "self.txt", "--force", *M(ws)], 1, "the document itself", check=_untouched("self.txt", b"some words " * 40)),
    Case("-o the document itself (no --force)", "outputs", lambda ws: ["ingest", ws.file("self2.txt", b"some words " * 40), "-o", ws.root / "self2.txt", *M(ws)], 1, "the document itself", before_model=True, check=_untouched("self2.txt", b"some words " * 40), notes="not 'pass --force': that would not help"),
    Case("stdin read from the output file (--force)", "outputs", lambda ws: [], 1, "the document itself", shell=lambda ws: f"{Q(ROCKETKV)} ingest - -o {Q(ws.file('self3.txt', b'some words ' * 40))} --force --model {Q(ws.model)} < {Q(ws.root / 'self3.txt')}", before_model=True, check=_untouched("self3.txt", b"some words " * 40)),
    Case("-o under a file (doc.txt/x.kv)", "outputs", lambda ws: ["ingest", ws.doc, "-o", ws.doc / "x.kv", *M(ws)], 1, "is a file", before_model=True, notes="not 'mkdir -p', which would fail there"),
    Case("--questions-file /dev/zero", "input", lambda ws: ["ask", "--cache", ws.kv, "--questions-file", "/dev/zero", *M(ws)], 1, "holds more than 16 MB of questions", before_model=True, notes="it was read until the machine ran out of memory"),
    Case("--questions-file in UTF-16", "questions", lambda ws: ["ask", "--cache", ws.kv, "--questions-file", ws.file("q16.txt", "Who?\nWhere?\n".encode("utf-16")), *M(ws)], 1, "is UTF-16 text", before_model=True, notes="answered as questions of NUL characters, exit 0"),
    Case("--questions-file of binary data", "questions", lambda ws: ["ask", "--cache", ws.kv, "--questions-file", ws.kv, *M(ws)], 1, "holds NUL bytes", before_model=True),
    Case("--questions-file a folder", "questions", lambda ws: ["ask", "--cache", ws.kv, "--questions-file", ws.root, *M(ws)], 1, "is a directory", before_model=True, notes="said Python's '[Errno 21]' text"),
    Case("--server with --no-server", "options", lambda ws: ["ask", "--cache", ws.kv, "Who?", "--no-server", "--server", "unix:/nowhere.sock"], 2, "give one of them", before_model=True, notes="answered here, the URL ignored"),
    Case("eval --json over an existing file", "outputs", lambda ws: ["eval", "--json", ws.file("report.json", b"{}"), *M(ws)], 1, "already exists", before_model=True, notes="replaced without --force, after the run"),
    Case("--questions-file - from /dev/zero", "input", lambda ws: [], 1, "stdin holds more than 16 MB", shell=lambda ws: f"{Q(ROCKETKV)} ask --cache {Q(ws.kv)} --questions-file - --model {Q(ws.model)} < /dev/zero", before_model=True),
    Case("chat from /dev/zero", "input", lambda ws: [], 1, "a line of the input is over", shell=lambda ws: f"{Q(ROCKETKV)} chat --cache {Q(ws.kv)} --model {Q(ws.model)} < /dev/zero", notes="one endless line: read up to 4M characters, not whole"),
    Case("-o a name of 300 characters", "outputs", lambda ws: ["ingest", ws.doc, "-o", ws.root / ("a" * 300 + ".kv"), *M(ws)], 1, "file name too long", notes="it was 'unexpected OSError'"),
    Case("--encoding utf-16 on a file without a BOM", "input", lambda ws: ["ingest", ws.file("nobom.txt", b"hello world\n"), "-o", ws.root / "nobom.kv", "--encoding", "utf-16", *M(ws)], 1, "is not valid utf-16", check=_no_file("nobom.kv"), notes="it was 'unexpected UnicodeError'"),
    Case("-o /dev/stdout (--force)", "outputs", lambda ws: ["ingest", ws.doc, "-o", "/dev/stdout", "--force", *M(ws)], 1, "is a system path", before_model=True, check=_dev_stdout_kept, notes="as root, the link /dev/stdout was replaced by the cache file"),
    Case("-o a FIFO (--force)", "outputs", lambda ws: ["ingest", ws.doc, "-o", fifo(ws), "--force", *M(ws)], 1, "not a regular file", check=_is_fifo),
    # cache files
    Case("cache from another model", "cache", lambda ws: ["ask", "--cache", ws.kv, QUESTION, "--model", other_model(ws)], 1, "another model"),
    Case("cache from another tokenizer", "cache", lambda ws: ["ask", "--cache", ws.kv, QUESTION, "--model", other_tokenizer(ws)], 1, "another tokenizer"),
    Case("truncated to 1%", "cache", lambda ws: ["ask", "--cache", truncated(ws, 0.01), QUESTION], 1, "is truncated: "),
    Case("truncated to 50%", "cache", lambda ws: ["ask", "--cache", truncated(ws, 0.5), QUESTION], 1, "truncated or damaged"),
    Case("truncated by one byte", "cache", lambda ws: ["ask", "--cache", truncated(ws, 0.99999), QUESTION], 1, "truncated or damaged"),
    Case("one payload byte flipped", "cache", lambda ws: ["ask", "--cache", flipped(ws), QUESTION], 1, "digest mismatch"),
    Case("metadata edited to claim other shapes", "cache", lambda ws: ["ask", "--cache", edited(ws, "shapes.kv", head_dim="8"), QUESTION], 1, "disagree with the metadata"),
    Case("n_context_tokens raised (metadata re-digested)", "cache", lambda ws: ["ask", "--cache", edited(ws, "ctx.kv", n_context_tokens="5000"), QUESTION], 1, "malformed metadata"),
    Case("config with max_new_tokens 0 (re-digested)", "cache", lambda ws: ["ask", "--cache", edited(ws, "cfg.kv", config='{"max_new_tokens": 0}'), QUESTION], 1, "malformed metadata"),
    Case("budgets with a page over topk (re-digested)", "cache", lambda ws: ["ask", "--cache", page_over_topk(ws), QUESTION], 1, "larger than its top-k"),
    Case("newer format version", "cache", lambda ws: ["ask", "--cache", edited(ws, "newer.kv", format_version="99"), QUESTION], 1, "newer than this rocketkv"),
    Case("random bytes named .kv", "cache", lambda ws: ["ask", "--cache", ws.file("random.kv", os.urandom(5000)), QUESTION], 1, "not a rocketkv cache"),
    Case("safetensors that is not a cache", "cache", lambda ws: ["ask", "--cache", foreign_safetensors(ws), QUESTION], 1, "not a rocketkv cache"),
    Case("header claiming enormous tensors", "cache", lambda ws: ["ask", "--cache", enormous(ws), QUESTION], 1, "truncated or damaged"),
    Case("inspect a damaged cache", "cache", lambda ws: ["inspect", flipped(ws)], 1, "digest mismatch"),
    Case("a FIFO as --cache", "cache", lambda ws: ["ask", "--cache", fifo(ws), QUESTION], 1, "not a regular file", before_model=True),
    Case("a directory as --cache", "cache", lambda ws: ["ask", "--cache", cache_directory(ws), QUESTION], 1, "is a directory", before_model=True),
    Case("unreadable cache (mode 000)", "cache", lambda ws: ["ask", "--cache", unreadable_cache(ws), QUESTION], 1, "no permission to read", drop_dac=True, before_model=True),
    Case("inspect an unreadable cache", "cache", lambda ws: ["inspect", unreadable_cache(ws)], 1, "no permission to read", drop_dac=True),
    Case("inspect with stdout closed", "cache", lambda ws: ["inspect", ws.kv], 1, "stdout is closed", close_stdout=True),
    Case("checkpoints of an ingest killed by SIGKILL (inspect)", "cache", lambda ws: ["inspect", _ab_cache(ws)], 0, "", log_has="rm -r", notes="reported with how to resume or remove them"),
    # questions
    Case("empty question", "questions", lambda ws: ["ask", "--cache", ws.kv, ""], 1, "empty question"),
    Case("question longer than the context", "questions", lambda ws: ["ask", "--cache", ws.kv, "why " * 1000], 1, "only"),
    Case("ask DOC on Latin-1 text", "input", lambda ws: ["ask", ws.file("latin1q.txt", "Café crème. ".encode("latin-1") * 9), QUESTION, *M(ws)], 1, "--errors replace", before_model=True),
    Case("ask DOC --errors replace (the hint above)", "input", lambda ws: ["ask", ws.file("latin1r.txt", "Café crème. ".encode("latin-1") * 9), QUESTION, "--errors", "replace", "--max-new-tokens", "3", *M(ws)], 0, "", notes="the option the hint names exists"),
    # a cache changed while `ask` runs (issue 17 item 1): the answer comes from the bytes verified
    Case("cache overwritten in place while ask runs", "cache", lambda ws: ["ask", "--cache", _fresh(ws, "inplace.kv"), QUESTION, "--max-new-tokens", "6"], 0, "", during=overwrite_in_place("inplace.kv"), or_error="digest mismatch", same_answer_as=lambda ws: ["ask", "--cache", ws.kv, QUESTION, "--max-new-tokens", "6"], notes="the answer of the intact file, or a one-line error"),
    Case("cache truncated while ask runs", "cache", lambda ws: ["ask", "--cache", _fresh(ws, "shrunk.kv"), QUESTION, "--max-new-tokens", "6"], 0, "", during=truncate_in_place("shrunk.kv"), or_error="truncated", same_answer_as=lambda ws: ["ask", "--cache", ws.kv, QUESTION, "--max-new-tokens", "6"], notes="never SIGBUS"),
    Case("segmented cache overwritten in place while ask runs", "cache", lambda ws: ["ask", "--cache", _segmented_copy(ws, "seg-inplace.kv"), QUESTION, "--max-new-tokens", "6"], 0, "", during=overwrite_in_place("seg-inplace.kv"), or_error="digest mismatch", same_answer_as=lambda ws: ["ask", "--cache", ws.root / "segmented-source.kv", QUESTION, "--max-new-tokens", "6"], notes="segments are read when used: the change is caught then"),
    Case("segmented cache truncated while ask runs", "cache", lambda ws: ["ask", "--cache", _segmented_copy(ws, "seg-shrunk.kv"), QUESTION, "--max-new-tokens", "6"], 0, "", during=truncate_in_place("seg-shrunk.kv"), or_error="truncated", same_answer_as=lambda ws: ["ask", "--cache", ws.root / "segmented-source.kv", QUESTION, "--max-new-tokens", "6"], notes="never SIGBUS"),
    # interruption
    Case("SIGINT during start-up", "interrupt", lambda ws: ["ingest", ws.doc, "-o", ws.root / "early.kv", *M(ws)], 130, "interrupted", send_signal=signal.SIGINT, signal_after_s=0.05, check=_no_file("early.kv"), notes="while the command line is imported"),
    Case("SIGTERM during start-up", "interrupt", lambda ws: ["ingest", ws.doc, "-o", ws.root / "early.kv", *M(ws)], 143, "terminated", send_signal=signal.SIGTERM, signal_after_s=0.05, check=_no_file("early.kv"), notes="while the command line is imported"),
    Case("SIGINT while the model libraries import", "interrupt", lambda ws: ["ingest", ws.doc, "-o", ws.root / "early.kv", *M(ws)], 130, "interrupted", send_signal=signal.SIGINT, signal_after_s=0.8, check=_no_file("early.kv"), notes="torch and transformers"),
    Case("SIGINT during ingest", "interrupt", lambda ws: ["ingest", ws.file("long.txt", b"word " * 700), "-o", ws.root / "sigint.kv", "--chunk-tokens", "4", *M(ws)], 130, "interrupted", send_signal=signal.SIGINT, check=_no_partial_then("sigint.kv")),
    Case("SIGTERM during ingest", "interrupt", lambda ws: ["ingest", ws.file("long.txt", b"word " * 700), "-o", ws.root / "sigterm.kv", "--chunk-tokens", "4", *M(ws)], 143, "terminated", send_signal=signal.SIGTERM, check=_no_partial_then("sigterm.kv")),
    Case("SIGHUP during ingest", "interrupt", lambda ws: ["ingest", ws.file("long.txt", b"word " * 700), "-o", ws.root / "sighup.kv", "--chunk-tokens", "4", *M(ws)], 129, "hung up", send_signal=signal.SIGHUP, check=_no_partial_then("sighup.kv"), notes="the terminal closed: cleaned up as after SIGTERM"),
    Case("SIGINT during ask", "interrupt", lambda ws: ["ask", "--cache", ws.kv, "--questions-file", ws.file("qs.txt", b"Which word?\n" * 300), "--max-new-tokens", "6"], 130, "interrupted", send_signal=signal.SIGINT),
    Case("SIGTERM during ask", "interrupt", lambda ws: ["ask", "--cache", ws.kv, "--questions-file", ws.file("qs.txt", b"Which word?\n" * 300), "--max-new-tokens", "6"], 143, "terminated", send_signal=signal.SIGTERM),
]  # fmt: skip
