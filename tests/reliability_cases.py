"""Bad input, damaged caches, failing writes and interruptions: one table of cases for the installed CLI.

Used by `tests/test_reliability.py` (asserts each case) and `scripts/reliability_report.py`
(writes `docs/reliability.md` from the same runs), so the document cannot drift from the tests.
"""

from __future__ import annotations

import json
import os
import resource
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
    send_signal: int | None = None  # sent once the model is loaded
    check: Callable[[Workspace], None] | None = None
    notes: str = ""


@dataclass
class Outcome:
    command: str
    code: int
    error_line: str
    stdout: str
    stderr: str
    extra: dict = field(default_factory=dict)


def _cmd(ws: Workspace, case: Case) -> list[str]:
    argv = [ROCKETKV, *map(str, case.args(ws))]
    if case.drop_dac and os.geteuid() == 0:
        argv = ["setpriv", "--bounding-set", "-dac_override,-dac_read_search", "--", *argv]
    return argv


def default_sigint() -> None:
    """In the child: Ctrl-C handled normally even when the tests run as a background job (which
    starts with SIGINT ignored, and so would its children)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def run_case(ws: Workspace, case: Case) -> Outcome:
    """Run one case's command in a subprocess and collect what it printed."""
    argv = _cmd(ws, case)

    def limits():
        if case.file_size_limit is not None:
            resource.setrlimit(resource.RLIMIT_FSIZE, (case.file_size_limit, case.file_size_limit))

    if case.send_signal is None:
        r = subprocess.run(argv, capture_output=True, text=True, env=ws.env, input=case.stdin, preexec_fn=limits,
                           timeout=300)  # fmt: skip
        out, errs, code = r.stdout, r.stderr, r.returncode
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
    shown = shown.replace(str(ws.root) + "/", "").replace(ROCKETKV, "rocketkv")
    if case.drop_dac and os.geteuid() == 0:
        shown = shown.replace("--bounding-set -dac_override,-dac_read_search -- ", "")
    return Outcome(command=shown, code=code, error_line=errors[0] if errors else "", stdout=out, stderr=errs)


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


def enormous(ws: Workspace) -> Path:
    path = ws.copy_kv("enormous.kv")
    n, header, data = _header(path)
    header["segments.0.layers.0.keys"]["shape"] = [1 << 20, 1 << 20, 1 << 12]
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


M = lambda ws: ["--model", ws.model]  # noqa: E731

CASES: list[Case] = [
    # input documents
    Case("missing document", "input", lambda ws: ["ingest", ws.root / "nope.txt", *M(ws)], 1, "not found"),
    Case("missing document with [markup] in its name", "input", lambda ws: ["ingest", ws.root / "notes[x][bold].txt", *M(ws)], 1, "notes[x][bold].txt"),
    Case("a directory", "input", lambda ws: ["ingest", ws.root / "home", "-o", ws.root / "d.kv", *M(ws)], 1, "is a directory"),
    Case("empty file", "input", lambda ws: ["ingest", ws.file("empty.txt", b""), *M(ws)], 1, "is empty"),
    Case("whitespace only", "input", lambda ws: ["ingest", ws.file("ws.txt", b" \n\t \n"), *M(ws)], 1, "whitespace only"),
    Case("binary file (NUL bytes)", "input", lambda ws: ["ingest", ws.file("bin.txt", b"\x7fELF\x02\x01\x00\x00"), *M(ws)], 1, "looks binary"),
    Case("Latin-1 text", "input", lambda ws: ["ingest", ws.file("latin1.txt", "Café crème, s'il vous plaît".encode("latin-1")), *M(ws)], 1, "not valid utf-8"),
    Case("Latin-1 text with --encoding latin-1", "input", lambda ws: ["ingest", ws.file("latin1ok.txt", ("Café crème. " * 30).encode("latin-1")), "-o", ws.root / "latin1-keep.kv", "--encoding", "latin-1", *M(ws)], 0, "", notes="decodes and ingests"),
    Case("UTF-16 text", "input", lambda ws: ["ingest", ws.file("utf16.txt", "hello there".encode("utf-16")), *M(ws)], 1, "--encoding utf-16"),
    Case("unreadable permissions", "input", lambda ws: ["ingest", unreadable(ws), *M(ws)], 1, "no permission", drop_dac=True),
    Case("document longer than the context", "input", lambda ws: ["ingest", ws.file("huge.txt", b"word " * 1000), "-o", ws.root / "h.kv", *M(ws)], 0, "", check=_segmented_check, notes="ingested in 2 segments"),
    Case("--segment-tokens too small for the framing", "options", lambda ws: ["ingest", ws.doc, "-o", ws.root / "s.kv", "--segment-tokens", "64", *M(ws)], 1, "no room for text"),
    Case("--segment-tokens over the context", "options", lambda ws: ["ingest", ws.doc, "-o", ws.root / "s.kv", "--segment-tokens", "100000", *M(ws)], 1, "more than this model's context fits"),
    Case("--segment on a one-segment cache", "questions", lambda ws: ["ask", "--cache", ws.kv, "--segment", "3", QUESTION], 1, "one segment"),
    Case("- with empty stdin", "input", lambda ws: ["ingest", "-", "-o", ws.root / "stdin.kv", *M(ws)], 1, "(stdin) is empty", stdin=""),
    # options
    Case("budget 0", "options", lambda ws: ["ingest", ws.doc, "-o", ws.root / "b.kv", "--budget", "0", *M(ws)], 1, "token_budget"),
    Case("negative budget", "options", lambda ws: ["ingest", ws.doc, "-o", ws.root / "b.kv", "--budget", "-5", *M(ws)], 1, "token_budget"),
    Case("non-integer budget", "options", lambda ws: ["ingest", ws.doc, "--budget", "lots", *M(ws)], 2, "", notes="usage error: Typer's message, exit 2"),
    Case("budget larger than the document", "options", lambda ws: ["ingest", ws.doc, "-o", ws.root / "big-budget.kv", "--budget", "100000", *M(ws)], 0, "", check=_full_cache_check, notes="keeps every token: full attention"),
    Case("--max-new-tokens 0", "options", lambda ws: ["ask", "--cache", ws.kv, QUESTION, "--max-new-tokens", "0"], 2, "", notes="usage error: Typer's range check, exit 2"),
    Case("ask --page-size larger than topk", "options", lambda ws: ["ask", "--cache", ws.kv, QUESTION, "--page-size", "100000000"], 1, "page_size"),
    Case("ask --topk 0", "options", lambda ws: ["ask", "--cache", ws.kv, QUESTION, "--topk", "0"], 1, "topk"),
    Case("unknown --errors handler", "options", lambda ws: ["ingest", ws.doc, "-o", ws.root / "e.kv", "--errors", "shrug", *M(ws)], 1, "--errors"),
    Case("prompt budget below the window", "options", lambda ws: ["ingest", ws.doc, "-o", ws.root / "w.kv", "--budget", "2", "--max-new-tokens", "600", *M(ws)], 1, "below the observation window"),
    Case("unknown model name", "options", lambda ws: ["ingest", ws.doc, "-o", ws.root / "m.kv", "--model", "no-such-model"], 1, "unknown model"),
    Case("model directory without weights", "options", lambda ws: ["ingest", ws.doc, "-o", ws.root / "m.kv", "--model", no_weights(ws)], 1, "no *.safetensors"),
    Case("unsupported architecture", "options", lambda ws: ["ingest", ws.doc, "-o", ws.root / "m.kv", "--model", unsupported(ws)], 1, "unsupported architecture"),
    Case("--device cuda without a GPU", "options", lambda ws: ["ingest", ws.doc, "-o", ws.root / "c.kv", "--device", "cuda", *M(ws)], 1, "no CUDA GPU"),
    # outputs
    Case("-o into a missing directory", "outputs", lambda ws: ["ingest", ws.doc, "-o", ws.root / "no" / "x.kv", *M(ws)], 1, "does not exist"),
    Case("-o into a read-only directory", "outputs", lambda ws: ["ingest", ws.doc, "-o", read_only_dir(ws), *M(ws)], 1, "cannot write", drop_dac=True, check=_no_partial_then("ro/out.kv")),
    Case("target exists (no --force)", "outputs", lambda ws: ["ingest", ws.doc, "-o", existing_target(ws), *M(ws)], 1, "already exists", check=_untouched("existing.kv", b"old contents")),
    Case("target is a symlink (no --force)", "outputs", lambda ws: ["ingest", ws.doc, "-o", symlink_target(ws), *M(ws)], 1, "already exists", check=_symlink_check),
    Case("target is a symlink (--force)", "outputs", lambda ws: ["ingest", ws.doc, "-o", symlink_target(ws), "--force", *M(ws)], 0, "", check=_symlink_check, notes="the link is replaced by the new file; its target is untouched"),
    Case("write fails half-way (file size limit)", "outputs", lambda ws: ["ingest", ws.doc, "-o", existing_target(ws), "--force", *M(ws)], 1, "cannot write", file_size_limit=10_000, check=_untouched("existing.kv", b"old contents")),
    Case("-o the document itself (--force)", "outputs", lambda ws: ["ingest", ws.file("self.txt", b"some words " * 40), "-o", ws.root / "self.txt", "--force", *M(ws)], 1, "the document itself", check=_untouched("self.txt", b"some words " * 40)),
    Case("-o a FIFO (--force)", "outputs", lambda ws: ["ingest", ws.doc, "-o", fifo(ws), "--force", *M(ws)], 1, "not a regular file", check=_is_fifo),
    # cache files
    Case("cache from another model", "cache", lambda ws: ["ask", "--cache", ws.kv, QUESTION, "--model", other_model(ws)], 1, "another model"),
    Case("cache from another tokenizer", "cache", lambda ws: ["ask", "--cache", ws.kv, QUESTION, "--model", other_tokenizer(ws)], 1, "another tokenizer"),
    Case("truncated to 1%", "cache", lambda ws: ["ask", "--cache", truncated(ws, 0.01), QUESTION], 1, "rocketkv ingest"),
    Case("truncated to 50%", "cache", lambda ws: ["ask", "--cache", truncated(ws, 0.5), QUESTION], 1, "truncated or damaged"),
    Case("truncated by one byte", "cache", lambda ws: ["ask", "--cache", truncated(ws, 0.99999), QUESTION], 1, "truncated or damaged"),
    Case("one payload byte flipped", "cache", lambda ws: ["ask", "--cache", flipped(ws), QUESTION], 1, "digest mismatch"),
    Case("metadata edited to claim other shapes", "cache", lambda ws: ["ask", "--cache", edited(ws, "shapes.kv", head_dim="8"), QUESTION], 1, "disagree with the metadata"),
    Case("n_context_tokens raised (metadata re-digested)", "cache", lambda ws: ["ask", "--cache", edited(ws, "ctx.kv", n_context_tokens="5000"), QUESTION], 1, "malformed metadata"),
    Case("config with max_new_tokens 0 (re-digested)", "cache", lambda ws: ["ask", "--cache", edited(ws, "cfg.kv", config='{"max_new_tokens": 0}'), QUESTION], 1, "malformed metadata"),
    Case("newer format version", "cache", lambda ws: ["ask", "--cache", edited(ws, "newer.kv", format_version="99"), QUESTION], 1, "newer than this rocketkv"),
    Case("random bytes named .kv", "cache", lambda ws: ["ask", "--cache", ws.file("random.kv", os.urandom(5000)), QUESTION], 1, "not a rocketkv cache"),
    Case("safetensors that is not a cache", "cache", lambda ws: ["ask", "--cache", foreign_safetensors(ws), QUESTION], 1, "not a rocketkv cache"),
    Case("header claiming enormous tensors", "cache", lambda ws: ["ask", "--cache", enormous(ws), QUESTION], 1, "truncated or damaged"),
    Case("inspect a damaged cache", "cache", lambda ws: ["inspect", flipped(ws)], 1, "digest mismatch"),
    # questions
    Case("empty question", "questions", lambda ws: ["ask", "--cache", ws.kv, ""], 1, "empty question"),
    Case("question longer than the context", "questions", lambda ws: ["ask", "--cache", ws.kv, "why " * 1000], 1, "only"),
    # interruption
    Case("SIGINT during ingest", "interrupt", lambda ws: ["ingest", ws.file("long.txt", b"word " * 700), "-o", ws.root / "sigint.kv", "--chunk-tokens", "4", *M(ws)], 130, "interrupted", send_signal=signal.SIGINT, check=_no_partial_then("sigint.kv")),
    Case("SIGTERM during ingest", "interrupt", lambda ws: ["ingest", ws.file("long.txt", b"word " * 700), "-o", ws.root / "sigterm.kv", "--chunk-tokens", "4", *M(ws)], 143, "terminated", send_signal=signal.SIGTERM, check=_no_partial_then("sigterm.kv")),
    Case("SIGINT during ask", "interrupt", lambda ws: ["ask", "--cache", ws.kv, "--questions-file", ws.file("qs.txt", b"Which word?\n" * 300), "--max-new-tokens", "6"], 130, "interrupted", send_signal=signal.SIGINT),
    Case("SIGTERM during ask", "interrupt", lambda ws: ["ask", "--cache", ws.kv, "--questions-file", ws.file("qs.txt", b"Which word?\n" * 300), "--max-new-tokens", "6"], 143, "terminated", send_signal=signal.SIGTERM),
]  # fmt: skip
