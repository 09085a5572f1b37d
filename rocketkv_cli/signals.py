"""Signal state of the `rocketkv` process, standard library only: the SIGINT, SIGTERM and SIGHUP
handlers (`install`, raising KeyboardInterrupt or `Terminated`), the signals received (`received`,
`handled`) and the one-line exit for them (`exit_for_signal`: 130, 143 or 129). SIGHUP (the
terminal closed, an ssh session dropped) ends a command as SIGTERM does, its cleanup run: no
temporary file or half-converted model left behind.

The console script (`entry.py`) installs the handlers before the heavy imports; `cli/common.py`
reads the state so that an interrupt that a library turned into another exception on its way up
(an import interrupted half-way resurfaces later as an ImportError) still exits as an interrupt,
not as an "unexpected" error.
"""

from __future__ import annotations

import signal
import sys

EXIT_CODES: dict[int, int] = {signal.SIGINT: 130, signal.SIGTERM: 143, signal.SIGHUP: 129}
MESSAGES: dict[int, str] = {signal.SIGINT: "interrupted", signal.SIGTERM: "terminated",
                            signal.SIGHUP: "hung up (the terminal closed)"}  # fmt: skip
HANDLED = tuple(EXIT_CODES)  # the signals this module handles
_received: list[int] = []  # signal numbers received by this process, in order
_reported: list[int] = []  # signals whose one-line message was printed (here or by `cli.common`)
_done: list[str] = []  # what the command finished before a signal came ("out.kv was written")


class Terminated(BaseException):
    """Raised by the SIGTERM and SIGHUP handler so that cleanup (`finally`) runs before exit 143
    (129). A BaseException, like KeyboardInterrupt, so that `except Exception` blocks do not
    swallow it. signum: the signal that raised it."""

    def __init__(self, signum: int = signal.SIGTERM) -> None:
        super().__init__(signum)
        self.signum = signum


def _on_signal(signum: int, frame) -> None:  # pragma: no cover - exercised through subprocess tests
    _received.append(signum)
    if signum != signal.SIGINT:
        raise Terminated(signum)
    raise KeyboardInterrupt()


def install() -> None:
    """Handle SIGINT, SIGTERM and SIGHUP by raising (KeyboardInterrupt, `Terminated`) and recording
    them.

    A signal that was ignored when the process started (a background job started with SIGINT
    ignored, SIGHUP under `nohup`) stays ignored, as the shell intended. Idempotent."""
    for signum in HANDLED:
        if signal.getsignal(signum) not in (signal.SIG_IGN, None):
            signal.signal(signum, _on_signal)


def _record(signum: int, frame) -> None:  # pragma: no cover - exercised through subprocess tests
    if _received:  # the second: the exit is stuck (a thread that never ends, a slow handler): end it now
        import os

        report(signum)
        os._exit(EXIT_CODES[signum])
    _received.append(signum)


def defer() -> None:
    """From now on a first SIGINT, SIGTERM or SIGHUP is only recorded (`received`), not raised: for the
    exit after a command, whose handlers (`atexit`, finalizers) print an exception raised inside
    them as a traceback and go on, so the process would exit 0 after a signal. A second one ends
    the process at once with its line and code, as the exit may be stuck. Those ignored at start
    stay ignored."""
    for signum in HANDLED:
        if signal.getsignal(signum) not in (signal.SIG_IGN, None):
            signal.signal(signum, _record)


def received() -> int | None:
    """The first SIGINT/SIGTERM/SIGHUP this process received (a signal number), or None."""
    return _received[0] if _received else None


def handled() -> None:
    """Forget the signals received so far: the command dealt with them (`chat` cancels an answer on
    Ctrl-C and goes on), so they must not turn its later exit into an interrupt's."""
    _received.clear()


def note_done(what: str) -> None:
    """Record work the command finished for good ("out.kv was written"): an interrupt after it
    says so, so that exit code 130 is not read as "nothing was changed"."""
    _done.append(what)


def message(signum: int) -> str:
    """The one-line message for `signum`: "interrupted", or "interrupted after out.kv was written"."""
    return MESSAGES[signum] + (f" after {' and '.join(_done)}" if _done else "")


def mark_reported(signum: int) -> None:
    """Note that the message for `signum` was printed (so that it is printed once)."""
    _reported.append(signum)


def exit_for_signal(signum: int) -> None:
    """Print the one-line message for `signum` on stderr unless it was printed already, and exit
    with its code (no Rich needed)."""
    for other in HANDLED:  # a second Ctrl-C must not interrupt the exit itself
        signal.signal(other, signal.SIG_IGN)
    report(signum)
    raise SystemExit(EXIT_CODES[signum])


def report(signum: int) -> None:
    """Print the one-line message for `signum` on stderr, once per process (no Rich needed)."""
    if _reported:
        return
    try:
        sys.stderr.write(f"Error: {message(signum)}\n")
        sys.stderr.flush()
    except (OSError, ValueError, AttributeError):  # stderr closed: the exit code still says it
        pass
    mark_reported(signum)
