"""The `rocketkv` console script. It installs the signal handling first (`signals.py`) and only
then imports the command line (Typer, Rich, and through the commands torch and transformers), so
that Ctrl-C, SIGTERM or SIGHUP at any moment ends with one line and the usual exit code: 130
(SIGINT), 143 (SIGTERM), 129 (SIGHUP).

Standard library only: this module runs before anything heavy is imported. The signal state lives
in `signals.py`, which `cli/common.py` reads too (so that an interrupt that a library turned into
another exception on its way up still exits as an interrupt), and nothing below imports this
module: no import circle.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys

from .signals import EXIT_CODES, Terminated, defer, exit_for_signal, install, received, report


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
    import threading

    status = 0 if code is None else code if isinstance(code, int) else 1
    if not isinstance(code, (int, type(None))):
        sys.stderr.write(f"{code}\n")  # what SystemExit would print for a message
    defer()  # a signal from here on is recorded, not raised inside an exit handler (which prints it)
    try:
        # what a normal exit runs, in its order: threading's exit hooks (idle thread-pool workers
        # are told to stop) and the join of non-daemon threads, then the atexit handlers and
        # weakref finalizers
        getattr(threading, "_shutdown", lambda: None)()
        atexit._run_exitfuncs()
    except KeyboardInterrupt:  # raised by other code while those run: its exit code, as everywhere else
        os._exit(EXIT_CODES[signal.SIGINT])
    except Terminated as stop:
        os._exit(EXIT_CODES[stop.signum])
    signum = received()
    if signum is not None:  # a signal while the exit ran: its line ("terminated after out.kv was written") and code
        report(signum)
        status = EXIT_CODES[signum]
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
    for stream in (sys.stdout, sys.stderr):  # a character the terminal's encoding lacks (PYTHONIOENCODING=ascii,
        if hasattr(stream, "reconfigure"):  # a Latin-1 locale) is written escaped, not an error that loses the answer
            stream.reconfigure(errors="backslashreplace")
    for name in ("COLUMNS", "LINES"):  # a width or height of 0: Rich (and Typer's help) would draw nothing, errors
        if os.environ.get(name, "").strip().isdigit() and int(os.environ[name]) == 0:  # included: as if unset
            del os.environ[name]
    if not os.environ.get("OMP_NUM_THREADS", "x").strip():  # set but empty: unset, as rocketkv reads it, before
        del os.environ["OMP_NUM_THREADS"]  # torch loads OpenMP, which warns twice about an empty value
    try:
        from .cli import app, with_bare_ray  # the slow imports: from here on an interrupt is ours to report

        app(args=with_bare_ray(sys.argv[1:]))
    except KeyboardInterrupt:
        exit_for_signal(signal.SIGINT)
    except Terminated as stop:
        exit_for_signal(stop.signum)
    except SystemExit as done:
        signum = received()
        if signum is None:
            _exit_now(done.code)  # the command ran to its end
            raise
        exit_for_signal(signum)  # Typer's own handler exits 130 silently (an interrupt while it parses)
    except OSError as exc:  # outside a command's own handling: `--help > /dev/full` (help and version print here)
        signum = received()
        if signum is not None:
            exit_for_signal(signum)
        if os.environ.get("ROCKETKV_DEBUG") == "1":
            raise
        closed = isinstance(exc, BrokenPipeError)  # `| head`: ends quietly, 128 + SIGPIPE, as Unix tools do
        if not closed:
            with contextlib.suppress(OSError, ValueError):
                sys.stderr.write(f"Error: cannot write the output: {exc.strerror or exc}\n")
        with contextlib.suppress(OSError, ValueError, AttributeError):  # the exit's flush of what is left, unwritten
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        _exit_now(141 if closed else 1)
        sys.exit(141 if closed else 1)
    except BaseException:
        signum = received()
        if signum is None:
            raise
        exit_for_signal(signum)  # an interrupt that resurfaced as another error (see the module docstring)
