"""The commands users type, run in a pseudo-terminal: Rich draws progress bars and spinners only
when stderr is a terminal, which no piped test exercises (a crash hid there: issue 16 item 1)."""

import os
import signal
import stat
import subprocess

import pytest
from conftest import run_in_terminal, strip_ansi, text_of_bytes

BAR, SPINNER = "━", "⠋⠙⠹⠸⠼⠴⠦⠧⠇⠏"


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    home = tmp_path_factory.mktemp("rkv-home")
    return {**os.environ, "ROCKETKV_HOME": str(home), "HF_HUB_OFFLINE": "1"}


@pytest.fixture(scope="module")
def doc(tmp_path_factory):
    path = tmp_path_factory.mktemp("tty") / "doc.txt"
    path.write_text(text_of_bytes(2500) + "\nThe secret code is 4242.\n")
    return path


def check_terminal_run(code: int, shown: str, want_bar: bool = True) -> list[str]:
    """Exit 0, a bar (or spinner) drawn, and every log line starting a line of its own.

    Returns the visible lines (ANSI escapes removed, split at carriage returns and newlines)."""
    assert code == 0, shown[-3000:]
    plain = strip_ansi(shown)
    assert "Error:" not in plain and "Traceback" not in plain, plain[-3000:]
    if want_bar:
        assert BAR in plain, f"no progress bar drawn: {plain[-2000:]!r}"
    else:
        assert BAR in plain or any(ch in plain for ch in SPINNER), f"no spinner drawn: {plain[-2000:]!r}"
    lines = [line for line in plain.replace("\r\n", "\n").replace("\r", "\n").split("\n")]
    glued = [line for line in lines if "rocketkv:" in line and not line.lstrip().startswith("rocketkv:")]
    assert not glued, f"log lines glued to another line: {glued[:3]}"
    return lines


@pytest.fixture(scope="module")
def kv(rocketkv_bin, env, doc, tiny_model_dir):
    out = doc.parent / "doc.kv"
    argv = [rocketkv_bin, "ingest", str(doc), "-o", str(out), "--model", str(tiny_model_dir), "--budget", "64",
            "--max-new-tokens", "6", "--chunk-tokens", "256"]  # fmt: skip
    code, shown = run_in_terminal(argv, env)
    lines = check_terminal_run(code, shown)
    assert str(out) in lines and out.is_file()
    return out


def test__ingest_in_a_terminal__draws_the_prefill_bar(kv):
    assert kv.stat().st_size > 0


def test__segmented_ingest_in_a_terminal(rocketkv_bin, env, doc, tiny_model_dir, tmp_path):
    out = tmp_path / "seg.kv"
    code, shown = run_in_terminal([rocketkv_bin, "ingest", str(doc), "-o", str(out), "--model", str(tiny_model_dir),
                                   "--budget", "64", "--segment-tokens", "800"], env)  # fmt: skip
    lines = check_terminal_run(code, shown)
    assert any("segment 1: prefilled" in line for line in lines), lines


def test__summarize_many_parts_in_a_terminal__a_line_per_part(rocketkv_bin, env, doc, tiny_model_dir, tmp_path):
    """A book's part summaries were printed whole on stderr (the KJV's 37: about 150 wrapped lines
    before its summary); on a terminal each is now one line, cut to its width (whole in a pipe)."""
    argv = [rocketkv_bin, "summarize", str(doc), "--model", str(tiny_model_dir), "--segment-tokens", "600"]
    code, shown = run_in_terminal(argv, env, columns=100)
    lines = check_terminal_run(code, shown, want_bar=False)
    parts = [line for line in lines if "rocketkv: summary of part " in line]
    assert len(parts) >= 3 and all(len(line) <= 100 for line in parts), parts
    assert any(line.endswith("…") for line in parts), parts
    piped = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=300)
    assert piped.returncode == 0 and any(len(line) > 100 for line in piped.stderr.splitlines()), piped.stderr


def test__reconstruct_ingest_in_a_terminal__the_bar_names_the_re_read(rocketkv_bin, env, doc, tiny_model_dir, tmp_path):
    """Context reconstruction re-reads the document after its prefill (the bar's slower second
    half): the bar says so, and a tail-window ingest's bar does not."""
    shown_by = {}
    for observation in ("reconstruct", "tail"):
        out = tmp_path / f"{observation}.kv"
        code, shown = run_in_terminal([rocketkv_bin, "ingest", str(doc), "-o", str(out), "--model",
                                       str(tiny_model_dir), "--budget", "64", "--chunk-tokens", "256",
                                       "--observation", observation], env)  # fmt: skip
        shown_by[observation] = "\n".join(check_terminal_run(code, shown))
    assert "prefill + re-read" in shown_by["reconstruct"] and "prefill + re-read" not in shown_by["tail"]


def test__ask_from_cache_in_a_terminal(rocketkv_bin, env, kv):
    code, shown = run_in_terminal([rocketkv_bin, "ask", "--cache", str(kv), "What is the code?"], env)
    check_terminal_run(code, shown, want_bar=False)


def test__ask_document_in_a_terminal(rocketkv_bin, env, doc, tiny_model_dir):
    code, shown = run_in_terminal([rocketkv_bin, "ask", str(doc), "What is the code?", "--model", str(tiny_model_dir),
                                   "--max-new-tokens", "4"], env)  # fmt: skip
    check_terminal_run(code, shown)


def test__summarize_in_a_terminal(rocketkv_bin, env, doc, tiny_model_dir):
    code, shown = run_in_terminal([rocketkv_bin, "summarize", str(doc), "--model", str(tiny_model_dir),
                                   "--max-new-tokens", "4"], env)  # fmt: skip
    check_terminal_run(code, shown)


def test__summarize_a_cache_in_a_terminal__a_spinner_while_the_model_writes(rocketkv_bin, env, kv):
    """`summarize --cache` with the model writing drew nothing for seconds (a blank screen until
    its result); a "summarizing" spinner now shows, and its lines come out whole."""
    code, shown = run_in_terminal([rocketkv_bin, "summarize", "--cache", str(kv), "--no-server", "--write-from",
                                   "document", "--max-new-tokens", "24"], env)  # fmt: skip
    check_terminal_run(code, shown, want_bar=False)
    assert any(f"{ch} summarizing" in strip_ansi(shown) for ch in SPINNER), strip_ansi(shown)[-2000:]


def test__eval_in_a_terminal(rocketkv_bin, env, tiny_model_dir):
    code, shown = run_in_terminal([rocketkv_bin, "eval", "--model", str(tiny_model_dir), "--context-tokens", "300",
                                   "--budgets", "96", "--methods", "full,rocketkv", "--tasks", "niah_noise",
                                   "--samples", "1", "--max-new-tokens", "4"], env)  # fmt: skip
    assert_json_rows_on_their_own_lines(check_terminal_run(code, shown))


def test__bench_in_a_terminal(rocketkv_bin, env, doc, tiny_model_dir):
    code, shown = run_in_terminal([rocketkv_bin, "bench", "--model", str(tiny_model_dir), "--context-tokens", "300",
                                   "--source", str(doc), "--steps", "2", "--no-memory"], env)  # fmt: skip
    assert_json_rows_on_their_own_lines(check_terminal_run(code, shown))


def assert_json_rows_on_their_own_lines(lines: list[str]) -> None:
    """Result rows (stdout) printed while the bar runs start a line of their own, whole JSON,
    not glued to the bar's line (a user saw `… ETA …{"model": …`)."""
    import json

    rows = [line for line in lines if '{"' in line]
    assert rows, "no JSON row shown"
    for line in rows:
        assert line.lstrip().startswith('{"'), f"JSON row glued to another line: {line[:160]!r}"
        json.loads(line)


# -- issue 16: new commands and modes in a terminal ----------------------------------------------------------------


class Terminal:
    """A command on a pseudo-terminal that is its controlling terminal, as in a user's shell:
    keys typed are `send`, Ctrl-C (\\x03) reaches it as SIGINT, and `expect` waits for text."""

    def __init__(self, argv: list[str], env: dict, columns: int = 100):
        import fcntl
        import pty
        import struct
        import subprocess
        import termios

        self.master, slave = pty.openpty()
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, columns, 0, 0))
        env = {**env, "TERM": "xterm-256color", "COLUMNS": str(columns)}
        env.pop("NO_COLOR", None)

        def controlling_terminal():  # runs in the child after setsid(), as an interactive shell starts a job:
            fcntl.ioctl(0, termios.TIOCSCTTY, 0)
            for signum in (signal.SIGINT, signal.SIGQUIT):  # default dispositions, even when this test runs
                signal.signal(signum, signal.SIG_DFL)  # under nohup or `cmd &` (which ignore SIGINT)

        self.proc = subprocess.Popen(argv, stdin=slave, stdout=slave, stderr=slave, env=env, close_fds=True,
                                     start_new_session=True, preexec_fn=controlling_terminal)  # fmt: skip
        os.close(slave)
        self.shown = b""

    def send(self, keys: str) -> None:
        os.write(self.master, keys.encode())

    def _read(self, timeout: float) -> bool:
        import select

        ready, _, _ = select.select([self.master], [], [], timeout)
        if not ready:
            return True
        try:
            data = os.read(self.master, 65536)
        except OSError:  # EIO: the child side closed
            return False
        self.shown += data
        return bool(data)

    def expect(self, text: str, after: int = 0, timeout: float = 300) -> int:
        """Wait until `text` is shown past byte `after`; returns where it ends."""
        import time

        deadline = time.monotonic() + timeout
        while (at := strip_ansi(self.shown.decode("utf-8", "replace")).find(text, after)) < 0:
            if time.monotonic() > deadline or not self._read(0.2) and self.proc.poll() is not None:
                raise AssertionError(f"{text!r} not shown; the terminal showed: {self.plain()[-3000:]!r}")
        return at + len(text)

    def plain(self) -> str:
        return strip_ansi(self.shown.decode("utf-8", "replace"))

    def wait(self, timeout: float = 120) -> int:
        import time

        deadline = time.monotonic() + timeout
        while self.proc.poll() is None and time.monotonic() < deadline:
            self._read(0.2)
        while self._read(0.1) and self.proc.poll() is not None and len(self.shown) < 10**7:
            pass
        os.close(self.master)
        return self.proc.wait(timeout=10)


def test__chat_in_a_terminal__history_ctrl_c_cancels_the_answer_ctrl_d_quits(rocketkv_bin, env, kv, tmp_path):
    """`rocketkv chat`: the model and cache load once; Ctrl-C during an answer cancels that
    answer only; Up + Enter asks the last question again (readline history), and with the same
    seed it is answered the same way again (the cancelled answer left no trace); Ctrl-D quits, 0."""
    home = tmp_path / "home"
    question = "Tell me everything, at length."
    # seed 5: this answer runs 615 tokens before its end-of-text (~0.7 s here; `ask --seed 5` gives the
    # same), so Ctrl-C, sent once 40 characters are shown, lands while it is being decoded
    term = Terminal([rocketkv_bin, "chat", "--cache", str(kv), "--max-new-tokens", "1000", "--temperature", "1.5",
                     "--seed", "5"], {**env, "ROCKETKV_HOME": str(home)})  # fmt: skip
    at = term.expect("> ")
    answers = []
    for keys in (question + "\r", "\x1b[A\r"):  # the question, then Up + Enter: the same from the history
        term.send(keys)
        start = term.expect(question + "\r\n", at)
        while len(term.plain()) < start + 40:  # the answer is being printed
            assert term._read(1.0) or term.proc.poll() is None, term.plain()[-2000:]
        term.send("\x03")
        at = term.expect("rocketkv: answer cancelled", start)
        answers.append(term.plain()[start:at].split("^C")[0].split("\r\n")[0])
        at = term.expect("> ", at)
    term.send("\x04")  # Ctrl-D
    code = term.wait()
    shown = term.plain()
    assert code == 0, shown[-2000:]
    shorter, longer = sorted(answers, key=len)
    assert len(shorter) >= 20 and longer.startswith(shorter), answers
    assert shown.count("rocketkv: loaded") == 1 and shown.count("rocketkv: answer cancelled") == 2
    assert "Traceback" not in shown and "Error:" not in shown
    assert question in (home / "chat_history").read_text()
    assert "answered from the document on its own" in " ".join(shown.split()), shown[:600]  # no memory: said


def test__chat_in_a_terminal__its_banner_and_help_break_between_words(rocketkv_bin, env, kv, tmp_path):
    """At 80 columns the banner (~170 characters) and /help were left to the terminal, which broke
    them inside words ("answe" / "r"); Rich breaks them between words now."""
    term = Terminal([rocketkv_bin, "chat", "--cache", str(kv)], {**env, "ROCKETKV_HOME": str(tmp_path / "h")}, 80)
    at = term.expect("> ")
    term.send("/help\r")
    at = term.expect("> ", at + 2)
    term.send("\x04")
    assert term.wait() == 0
    shown = term.plain()
    shown = shown[shown.index("rocketkv: chat with") :]  # the banner on: the spinners' lines before are erased
    lines = [line.split("\r")[-1].rstrip() for line in shown.split("\r\n")]  # what a line shows last
    assert all(len(line) <= 80 for line in lines), lines  # one raw line of ~170 characters before
    text = " ".join(line for line in lines if line)  # line breaks only where spaces were: the words whole
    from rocketkv_cli.cli.chat import HELP

    assert f"rocketkv: {HELP}" in text, lines
    assert "Ctrl-C cancels an answer, Ctrl-D or /quit quits, /help" in text, lines


def test__chat_in_a_terminal__a_line_and_ctrl_d_typed_during_an_answer_are_kept(rocketkv_bin, env, kv, tmp_path):
    """Typed while an answer is printed: a whole question is asked next (shown after the prompt),
    and a Ctrl-D then quits, 0 (readline took a Ctrl-D typed ahead for nothing and the prompt
    waited)."""
    term = Terminal([rocketkv_bin, "chat", "--cache", str(kv), "--max-new-tokens", "1000", "--temperature", "1.5",
                     "--seed", "5"], {**env, "ROCKETKV_HOME": str(tmp_path / "home")})  # fmt: skip
    try:
        at = term.expect("> ")
        term.send("Tell me everything, at length.\r")  # 615 tokens (the test above)
        start = term.expect("at length.\r\n", at)
        while len(term.plain()) < start + 40:  # the answer is being printed
            assert term._read(1.0) or term.proc.poll() is None, term.plain()[-2000:]
        term.send("Which word?\r\x04")
        at = term.expect("> Which word?\r\n", start)
        code = term.wait(timeout=60)
    finally:
        term.proc.kill()
    shown = term.plain()
    assert code == 0, shown[-2000:]
    assert "Traceback" not in shown and "Error:" not in shown, shown[-2000:]


def test__chat_in_a_terminal__lines_pasted_at_the_prompt_are_asked_one_by_one(rocketkv_bin, env, kv, tmp_path):
    """Three questions pasted at once (each ended by Enter, "\\r", without bracketed paste): each is
    asked in turn and kept in the history. The first was answered and the other two put back on the
    line as one question with "^M" in it, to which whatever was typed next (/quit) was added."""
    home = tmp_path / "home"
    term = Terminal([rocketkv_bin, "chat", "--cache", str(kv), "--max-new-tokens", "2"],
                    {**env, "ROCKETKV_HOME": str(home)})  # fmt: skip
    at = term.expect("> ") - 2  # the first question is echoed after this prompt, the others after their own
    questions = ["What is the code?", "Which word?", "What is first?"]
    term.send("".join(q + "\r" for q in questions))
    for q in questions:
        at = term.expect(f"> {q}\r\n", at)
        at = term.expect("rocketkv: answered", at)
    term.expect("> ", at)
    term.send("/quit\r")
    assert term.wait() == 0, term.plain()[-2000:]
    assert "^M" not in term.plain() and "Error:" not in term.plain(), term.plain()[-2000:]
    kept = (home / "chat_history").read_text().splitlines()
    assert [line for line in kept if not line.startswith("_HiStOrY")][-3:] == questions, kept


def test__chat_in_a_terminal__a_fifo_as_its_history_file__prompts_without_it(rocketkv_bin, env, kv, tmp_path):
    """A FIFO where the history file goes (`mkfifo ~/.cache/rocketkv/chat_history`): chat hung
    before its prompt, opening it to read; it prompts and answers now, without a history."""
    home = tmp_path / "home"
    home.mkdir()
    os.mkfifo(home / "chat_history")
    term = Terminal([rocketkv_bin, "chat", "--cache", str(kv), "--max-new-tokens", "2"],
                    {**env, "ROCKETKV_HOME": str(home)})  # fmt: skip
    try:
        at = term.expect("> ", timeout=120)
        term.send("Which word?\r")
        at = term.expect("rocketkv: answered", at, timeout=60)
        term.expect("> ", at, timeout=60)
        term.send("/quit\r")
        code = term.wait(timeout=60)
    finally:
        term.proc.kill()
    assert code == 0 and "Error:" not in term.plain(), term.plain()[-2000:]
    assert stat.S_ISFIFO((home / "chat_history").stat().st_mode)  # left as it was


def test__ask_reading_questions_from_a_terminal__says_so(rocketkv_bin, env, kv):
    """`ask --cache F -` at a terminal waited with nothing shown; now it says it reads questions
    from the terminal and how to end them, then answers what was typed."""
    term = Terminal([rocketkv_bin, "ask", "--cache", str(kv), "--max-new-tokens", "2", "-"], env)
    try:
        at = term.expect("rocketkv: reading questions, one per line, from the terminal: type, then press Ctrl-D",
                         timeout=120)  # fmt: skip
        term.send("Which word?\r\x04")
        term.expect("rocketkv: answered", at, timeout=120)
        code = term.wait(timeout=60)
    finally:
        term.proc.kill()
    assert code == 0 and "Error:" not in term.plain(), term.plain()[-2000:]


def test__chat_focus_in_a_terminal__names_the_passages_then_streams_the_answer(rocketkv_bin, env, kv, tmp_path):
    """`chat --focus 1 --cite`: after a question, the stderr line naming the passage it is answered
    from, on its own line, then the answer and its Sources; Ctrl-D quits, 0."""
    term = Terminal([rocketkv_bin, "chat", "--cache", str(kv), "--focus", "1", "--cite"],
                    {**env, "ROCKETKV_HOME": str(tmp_path / "home")})  # fmt: skip
    at = term.expect("> ")
    term.send("What is the secret code?\r")
    at = term.expect("rocketkv: focus: answered from lines 2\r\n", at)
    at = term.expect("Sources:", at)
    at = term.expect("[1] line 2, characters", at)
    term.expect("> ", at)
    term.send("\x04")
    code = term.wait()
    shown = term.plain()
    assert code == 0 and "Traceback" not in shown and "Error:" not in shown, shown[-2000:]


def test__chat_history__keeps_questions_but_not_a_pasted_passage(rocketkv_bin, env, kv, tmp_path):
    """A pasted passage of 2,000+ characters asked in chat is left out of the history file (Up
    brought back 20 KB); the questions around it are kept, in order."""
    home = tmp_path / "home"
    term = Terminal([rocketkv_bin, "chat", "--cache", str(kv), "--max-new-tokens", "2"],
                    {**env, "ROCKETKV_HOME": str(home)})  # fmt: skip
    at = term.expect("> ")
    for question, said in (("What is the code?", "rocketkv: answered"),
                           ("word " * 420 + "which word?", "Error: question is"),  # over the tiny model's context
                           ("Which word?", "rocketkv: answered")):  # fmt: skip
        term.send(question + "\r")
        at = term.expect(said, at)
        at = term.expect("> ", at)
    term.send("\x04")
    assert term.wait() == 0, term.plain()[-2000:]
    kept = (home / "chat_history").read_text().splitlines()
    assert [line for line in kept if not line.startswith("_HiStOrY")] == ["What is the code?", "Which word?"], kept


def test__ask_several_questions_in_a_terminal__streamed_qa_records(rocketkv_bin, env, kv):
    code, shown = run_in_terminal([rocketkv_bin, "ask", "--cache", str(kv), "What is the code?", "Which word?",
                                   "--cite", "--passages", "1"], env)  # fmt: skip
    lines = check_terminal_run(code, shown, want_bar=False)
    starts = [line.split(":")[0] for line in lines if line.startswith(("Q:", "A:", "   Sources"))]
    assert starts == ["Q", "A", "   Sources", "Q", "A", "   Sources"], lines


@pytest.mark.parametrize(
    "args, says",
    [
        (["frob"], "No such command 'frob'"),
        (["ask", "--bogus", "q?"], "No such option: --bogus"),
        (["ingest"], "Missing argument 'DOCUMENT'"),  # as the usage line and --help spell it
        (["ask", "--cache", "x.kv", "q?", "--threads", "many"], "--threads"),
        (["ask", "--cache"], "'--cache' requires an argument"),
        (["ask"], "Error: no question: give --cache FILE.kv QUESTION..., or DOC QUESTION...; try"),
        (["ask", "What is it?"], "Error: no cache and no document for 'What is it?': give --cache FILE.kv"),
        (["asj"], "No such command 'asj'. Did you mean 'ask'? Try 'rocketkv --help'"),
    ],
    ids=[
        "unknown-command",
        "unknown-option",
        "missing-argument",
        "not-an-integer",
        "missing-value",
        "no-question",
        "a-question-without-cache",
        "a-misspelt-command",
    ],  # fmt: skip
)
def test__usage_errors_in_a_terminal__one_line_exit_2(rocketkv_bin, env, args, says):
    """What the option parser refuses reads as every other error does: one line, exit 2 (click's
    own layout was four: usage, hint, a blank line, the error)."""
    code, shown = run_in_terminal([rocketkv_bin, *args], env, timeout=120)
    lines = [line for line in strip_ansi(shown).replace("\r\n", "\n").split("\n") if line.strip()]
    assert code == 2 and len(lines) == 1, (code, lines)
    assert lines[0].startswith("Error: ") and says in lines[0] and "--help'" in lines[0], lines


def test__ask_focus_several_questions_in_a_terminal__the_note_between_q_and_a(rocketkv_bin, env, kv, tmp_path):
    """`ask --focus` names each question's passages on stderr: on a line of its own after the
    question, and the answer follows on its `A: ` line (the note used to land after `A: `)."""
    code, shown = run_in_terminal([rocketkv_bin, "ask", "--cache", str(kv), "--focus", "1", "What is the code?",
                                   "Which word?"], {**env, "ROCKETKV_HOME": str(tmp_path)})  # fmt: skip
    lines = check_terminal_run(code, shown, want_bar=False)
    kinds = [("Q" if line.startswith("Q: ") else "A" if line.startswith("A: ") else "note")
             for line in lines if line.startswith(("Q:", "A:", "rocketkv: focus:"))]  # fmt: skip
    assert kinds == ["Q", "note", "A", "Q", "note", "A"], lines
    assert not [line for line in lines if line.startswith("A:") and "rocketkv:" in line], lines


def test__bare_rocketkv_in_a_terminal__shows_the_help(rocketkv_bin, env):
    """No command: click's help, the commands listed on their own lines (not a one-line error)."""
    code, shown = run_in_terminal([rocketkv_bin], env, timeout=120)
    plain = strip_ansi(shown)
    assert "Commands:" in plain and "Error:" not in plain and "\n  ingest" in plain.replace("\r\n", "\n"), plain
    assert code in (0, 2), code


def test__models_in_a_terminal(rocketkv_bin, env, tmp_path):
    (tmp_path / "models" / "x-1").mkdir(parents=True)
    (tmp_path / "models" / "x-1" / "w").write_bytes(b"w" * 5)
    code, shown = run_in_terminal([rocketkv_bin, "models"], {**env, "ROCKETKV_HOME": str(tmp_path)})
    plain = strip_ansi(shown)
    assert code == 0 and "x-1" in plain and "5 B" in plain, plain


def test__ask_in_a_terminal__ctrl_c_mid_answer_ends_the_answer_line_then_130(rocketkv_bin, env, kv):
    """Ctrl-C while `ask` prints an answer: the error starts a line of its own (a user saw
    `…a copy^CError: interrupted`), exit 130, no traceback."""
    # seed 5: a 615-token answer (see the chat test above), so Ctrl-C lands while it is printed
    term = Terminal([rocketkv_bin, "ask", "--cache", str(kv), "Tell me everything, at length.", "--max-new-tokens",
                     "1000", "--temperature", "1.5", "--seed", "5", "--no-server"], env)  # fmt: skip
    start = term.expect("\r\n", term.expect("rocketkv: loaded"))  # one question: the answer alone follows
    while len(term.plain()) < start + 40:  # the answer is being printed
        assert term._read(1.0) or term.proc.poll() is None, term.plain()[-2000:]
    term.send("\x03")
    code = term.wait()
    shown = term.plain()
    assert code == 130, shown[-2000:]
    error = shown.index("Error: interrupted")
    assert shown[:error].rstrip(" ").endswith(("\n", "^C\r\n", "\r\n")), repr(shown[error - 80 : error + 20])
    assert "Traceback" not in shown


def test__a_model_path_with_brackets__shown_as_written_in_the_spinner(rocketkv_bin, env, kv, tmp_path):
    """The spinner's text was read as Rich markup: a model folder named `a[/b]` failed with
    "unexpected MarkupError" before anything loaded; it is the model's own error now."""
    odd = tmp_path / "a[/b]"
    code, shown = run_in_terminal([rocketkv_bin, "ask", "--cache", str(kv), "q?", "--no-server", "--model", str(odd)],
                                  env, timeout=120)  # fmt: skip
    text = strip_ansi(shown)
    assert code == 1 and "MarkupError" not in text and "Traceback" not in text, text
    assert "a[/b]" in text.split("Error:")[-1], text  # the error names the folder as given
