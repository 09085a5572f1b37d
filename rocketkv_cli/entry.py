"""The `rocketkv` console script. It installs the signal handling first and only then imports the
command line (Typer, Rich, and through the commands torch and transformers), so that Ctrl-C or
SIGTERM at any moment ends with one line and the usual exit code: 130 (SIGINT), 143 (SIGTERM).

Standard library only: this module runs before anything heavy is imported. `cli/common.py`
reads the signal state (`received`) so that an interrupt that a library turned into another
exception on its way up (an import interrupted half-way resurfaces later as an ImportError)
still exits as an interrupt, not as an "unexpected" error.
"""

from __future__ import annotations

import signal
import sys

EXIT_CODES: dict[int, int] = {signal.SIGINT: 130, signal.SIGTERM: 143}
MESSAGES: dict[int, str] = {signal.SIGINT: "interrupted", signal.SIGTERM: "terminated"}
_received: list[int] = []  # signal numbers received by this process, in order
_reported: list[int] = []  # signals whose one-line message was printed (here or by `cli.common`)


class Terminated(BaseException):
    """Raised by the SIGTERM handler so that cleanup (`finally`) runs before exit 143. A
    BaseException, like KeyboardInterrupt, so that `except Exception` blocks do not swallow it."""


def _on_signal(signum: int, frame) -> None:  # pragma: no cover - exercised through subprocess tests
    _received.append(signum)
    if signum == signal.SIGTERM:
        raise Terminated()
    raise KeyboardInterrupt()


def install() -> None:
    """Handle SIGINT and SIGTERM by raising (KeyboardInterrupt, `Terminated`) and recording them.

    A signal that was ignored when the process started (a background job started with SIGINT
    ignored, `nohup`) stays ignored, as the shell intended. Idempotent."""
    for signum in (signal.SIGINT, signal.SIGTERM):
        if signal.getsignal(signum) not in (signal.SIG_IGN, None):
            signal.signal(signum, _on_signal)


def received() -> int | None:
    """The first SIGINT/SIGTERM this process received (a signal number), or None."""
    return _received[0] if _received else None


def handled() -> None:
    """Forget the signals received so far: the command dealt with them (`chat` cancels an answer on
    Ctrl-C and goes on), so they must not turn its later exit into an interrupt's."""
    _received.clear()


def mark_reported(signum: int) -> None:
    """Note that the message for `signum` was printed (so that it is printed once)."""
    _reported.append(signum)


def exit_for_signal(signum: int) -> None:
    """Print the one-line message for `signum` on stderr unless it was printed already, and exit
    with its code (no Rich needed)."""
    for other in (signal.SIGINT, signal.SIGTERM):  # a second Ctrl-C must not interrupt the exit itself
        signal.signal(other, signal.SIG_IGN)
    if not _reported:
        try:
            sys.stderr.write(f"Error: {MESSAGES[signum]}\n")
            sys.stderr.flush()
        except (OSError, ValueError, AttributeError):  # stderr closed: the exit code still says it
            pass
        mark_reported(signum)
    raise SystemExit(EXIT_CODES[signum])


def _exit_now(code: object) -> None:
    """Finish a command that ran to its end: exit handlers run (Ray's shutdown, temporary folders),
    the standard streams are flushed, and the process ends without the interpreter's teardown.

    That teardown frees torch's and transformers' thousands of modules and objects one by one:
    about 2 s after every command that loaded a model, measured on a 2-core CPU, while nothing
    of rocketkv's is left to write (files are written atomically before a command returns).
    Without torch loaded there is nothing to save and the normal exit runs. Returns only then."""
    if "torch" not in sys.modules:
        return
    import atexit
    import os
    import threading

    status = 0 if code is None else code if isinstance(code, int) else 1
    if not isinstance(code, (int, type(None))):
        sys.stderr.write(f"{code}\n")  # what SystemExit would print for a message
    try:
        # what a normal exit runs, in its order: threading's exit hooks (idle thread-pool workers
        # are told to stop) and the join of non-daemon threads, then the atexit handlers and
        # weakref finalizers
        getattr(threading, "_shutdown", lambda: None)()
        atexit._run_exitfuncs()
    except KeyboardInterrupt:  # a signal while those run: its exit code, as everywhere else
        os._exit(EXIT_CODES[signal.SIGINT])
    except Terminated:
        os._exit(EXIT_CODES[signal.SIGTERM])
    for stream, closed_status in ((sys.stdout, 141), (sys.stderr, status)):
        try:
            if stream is not None:
                stream.flush()
        except BrokenPipeError:  # stdout's reader went away before the last lines: 128 + SIGPIPE
            status = status or closed_status
        except (OSError, ValueError):
            pass
    os._exit(status)


def main() -> None:
    """Console-script entry point (`rocketkv`, `python -m rocketkv_cli`)."""
    install()
    try:
        from .cli import app, with_bare_ray  # the slow imports: from here on an interrupt is ours to report

        app(args=with_bare_ray(sys.argv[1:]))
    except KeyboardInterrupt:
        exit_for_signal(signal.SIGINT)
    except Terminated:
        exit_for_signal(signal.SIGTERM)
    except SystemExit as done:
        signum = received()
        if signum is None:
            _exit_now(done.code)  # the command ran to its end
            raise
        exit_for_signal(signum)  # Typer's own handler exits 130 silently (an interrupt while it parses)
    except BaseException:
        signum = received()
        if signum is None:
            raise
        exit_for_signal(signum)  # an interrupt that resurfaced as another error (see the module docstring)
