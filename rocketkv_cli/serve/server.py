"""Start the server: bind its socket (a Unix socket with mode 0600, or TCP), run uvicorn on it until
`/v1/rocketkv/shutdown`, a signal, or the idle timeout, then remove the socket.

One server per socket: the server holds an exclusive `flock` on `<socket>.lock` for its whole life.
A socket file whose lock is free was left by a server that died (SIGKILL, a crash): it is stale and
is replaced. The kernel releases the lock of a killed process, so no pid guessing is needed.

The socket is bound before torch and the model stack are imported (seconds): a second server is
refused at once, and a client started right after `rocketkv serve &` finds the socket and waits for
the server (`client.starting_pid`: the lock file says "PID starting", then "PID ready") instead of
answering in its own process beside the server's imports.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import logging
import math
import os
import shlex
import signal
import socket
import stat
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import InputError
from .client import LOCK_READY, LOCK_STARTING, TCP_SERVERS, default_socket, home
from .config import ServeConfig

if TYPE_CHECKING:
    from .app import ServeState

Log = Callable[[str], None]


def _lock_path(path: Path) -> Path:
    return path.with_name(path.name + ".lock")


def _lock(path: Path) -> int:
    """Take `<socket>.lock` (exclusive, non-blocking). Raises InputError when a server holds it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    lock_path = _lock_path(path)
    try:
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)  # never through a planted link
    except OSError as exc:
        raise InputError(f"cannot open {lock_path}: {exc.strerror or exc}") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        named = "" if path == default_socket() else f" --socket {shlex.quote(str(path))}"  # the server on it
        hint = f"see `rocketkv serve status{named}`, or stop it with `rocketkv serve stop{named}`"
        raise InputError(f"a rocketkv server is already running on {path}", hint) from None
    mark(fd, LOCK_STARTING)
    return fd


def mark(lock_fd: int, state: str) -> None:
    """Say in the lock file whether the server is still starting (`LOCK_STARTING`) or serving
    (`LOCK_READY`): "PID STATE" (read by `client.starting_pid`)."""
    os.ftruncate(lock_fd, 0)
    os.pwrite(lock_fd, f"{os.getpid()} {state}\n".encode(), 0)


def release(lock_fd: int) -> None:
    """Empty the lock file (no "starting" left for a client to wait on once this process is gone)
    and let the lock go."""
    with contextlib.suppress(OSError):
        os.ftruncate(lock_fd, 0)
    os.close(lock_fd)


def bind_unix(path: Path) -> tuple[socket.socket, int]:
    """A listening Unix socket at `path` (mode 0600 from the start), and the lock's descriptor.
    A stale socket file (its server is gone: the lock was free) is replaced. Raises InputError."""
    had_lock = _lock_path(path).exists()
    lock_fd = _lock(path)
    try:
        if path.is_symlink() or path.exists():
            if not stat.S_ISSOCK(os.lstat(path).st_mode):  # a mix-up (--socket doc.kv): never delete a file
                if not had_lock:  # no server can ever listen there: the lock made for it goes too
                    _lock_path(path).unlink(missing_ok=True)
                raise InputError(f"{path} exists and is not a socket", "give --socket a new path")
            path.unlink()  # stale: the server that made it no longer holds the lock
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old = os.umask(0o177)  # no window in which another user could connect
        try:
            sock.bind(str(path))
        finally:
            os.umask(old)
        sock.listen(128)
    except (OSError, InputError) as exc:
        release(lock_fd)
        if isinstance(exc, InputError):
            raise
        raise InputError(f"cannot listen on {path}: {exc.strerror or exc}") from None
    return sock, lock_fd


def bind_tcp(host: str, port: int) -> socket.socket:
    """A listening TCP socket on host:port (port 0: a free one). Raises InputError."""
    try:
        info = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(info[0], socket.SOCK_STREAM)
    except OSError as exc:
        raise InputError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(info[4])
        sock.listen(128)
    except OSError as exc:
        sock.close()
        raise InputError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    return sock


def serve(cfg: ServeConfig, log: Log, announce: Callable[[str], None] = lambda url: None) -> None:
    """Run the server in the foreground until it is stopped (shutdown request, SIGINT/SIGTERM) or
    idle for `cfg.idle_timeout_s`; its socket is removed however it ends. Raises InputError when
    the socket cannot be had; KeyboardInterrupt or `signals.Terminated` (after the shutdown and
    the cleanup) when a signal stopped it (`cli/serve.py` logs that stop; `_run` the others).
    `announce(url)`: called with the address once it serves (`serve --json` prints it)."""
    lock_fd = None
    if cfg.socket is not None:
        sock, lock_fd = bind_unix(cfg.socket)
        url = cfg.url
    else:
        assert cfg.host is not None and cfg.port is not None  # ServeConfig: a socket or a host and port
        sock = bind_tcp(cfg.host, cfg.port)
        url = f"http://{cfg.host}:{sock.getsockname()[1]}"
    identity = os.stat(cfg.socket).st_ino if cfg.socket is not None else None
    listed = None if cfg.socket is not None else list_tcp_server(url)
    try:  # from here on the socket is removed however the server ends (a signal while it starts too)
        from ..api.rocketkv import configure  # torch and the model stack (seconds): after the socket is had

        configure(quiet=True, progress_bars=False)

        def ready() -> None:
            if lock_fd is not None:
                mark(lock_fd, LOCK_READY)
            mark_listed(listed)

        _run(cfg, state_for(cfg, url, log), sock, url, log, ready, announce)
    finally:
        sock.close()
        if cfg.socket is not None:
            try:
                if os.stat(cfg.socket).st_ino == identity:  # still ours: remove it
                    cfg.socket.unlink()
            except OSError:
                pass
        if lock_fd is not None:
            release(lock_fd)
        if listed is not None:
            listed.unlink(missing_ok=True)


def list_tcp_server(url: str) -> Path | None:
    """Note this TCP server in `$ROCKETKV_HOME/tcp-servers/PID` (its URL, then "starting" until
    `mark_listed` says "ready"), so that `rocketkv serve status` and `stop` without --port can name
    it (`client.tcp_servers`) and a client waits while it starts (`client.tcp_starting_pid`); None
    when that cannot be written (only the hint and the wait are lost)."""
    folder = home() / TCP_SERVERS
    try:
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / str(os.getpid())
        _write_listing(path, f"{url}\n{LOCK_STARTING}\n")
    except OSError:
        return None
    return path


def _write_listing(path: Path, text: str) -> None:
    """`text` into `path` whole (a temporary file renamed over it: a reader never sees half a URL,
    and a link planted at `path` is replaced, not written through). Raises OSError."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def mark_listed(listed: Path | None) -> None:
    """Say in a TCP server's `tcp-servers/PID` file that it serves now (clients stop waiting)."""
    if listed is not None:
        with contextlib.suppress(OSError):
            url = listed.read_text().partition("\n")[0]
            _write_listing(listed, f"{url}\n{LOCK_READY}\n")


def state_for(cfg: ServeConfig, url: str, log: Log = lambda message: None) -> ServeState:
    """The server's state for `cfg`: its warm set (budget, threads; its model loads logged with
    `log`), limits and counters."""
    from .app import ServeState
    from .warm import Warm

    warm = Warm(cfg.memory_budget, cfg.threads, cfg.compile_step, log)
    return ServeState(warm=warm, roots=cfg.allow_dirs, api_key=cfg.api_key,
                      trust_remote_code=cfg.trust_remote_code, host=cfg.host,
                      url=url, idle_timeout_s=cfg.idle_timeout_s, max_queue=cfg.max_queue,
                      max_body_bytes=cfg.max_body_bytes, max_tokens_limit=cfg.max_tokens_limit)  # fmt: skip


HEADERS_TIMEOUT_S = 10.0  # a new connection that has not sent its request's headers by then is closed


def _timed_protocol() -> type:
    """uvicorn's h11 protocol, with a connection closed when a request's headers are not all there
    `HEADERS_TIMEOUT_S` after it opened or after its last response (uvicorn times out only idle
    keep-alive connections, and restarts that timer at every byte): connections that sent part of
    a request, then a byte now and then, were held open for ever, and 20,000 of them took every
    file descriptor (no request could be answered, `/health` timed out)."""
    from uvicorn.protocols.http.h11_impl import H11Protocol, h11  # uvicorn's own h11 (its HTTP/1.1 parser)

    class TimedH11Protocol(H11Protocol):
        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm()

        def on_response_complete(self) -> None:  # a kept-alive connection waits for its next request's headers
            super().on_response_complete()
            self._arm()

        def _arm(self) -> None:
            timer = getattr(self, "_headers_timer", None)
            if timer is not None:
                timer.cancel()
            self._waiting_since = self.cycle  # a new request replaces the cycle once its headers are all there
            self._headers_timer = self.loop.call_later(HEADERS_TIMEOUT_S, self._headers_too_slow)

        def _headers_too_slow(self) -> None:
            if self.cycle is self._waiting_since and not self.transport.is_closing():  # no request began since
                self.transport.close()

        def connection_lost(self, exc: Exception | None) -> None:
            self._headers_timer.cancel()
            super().connection_lost(exc)

        def send_400_response(self, msg: str) -> None:  # uvicorn's is text/plain: every refusal here is JSON
            error = {"message": "malformed HTTP request: it cannot be parsed as HTTP/1.1", "type": "UsageError",
                     "hint": None, "param": None, "code": 400}  # fmt: skip
            body = json.dumps({"error": error}).encode()
            headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                       (b"connection", b"close")]  # fmt: skip
            for event in (h11.Response(status_code=400, headers=headers, reason=b"Bad Request"), h11.Data(data=body),
                          h11.EndOfMessage()):  # fmt: skip
                try:
                    self.transport.write(self.conn.send(event))
                except h11.LocalProtocolError:  # a state where h11 sends no response (uvicorn's would fail too)
                    break
            self.transport.close()

    return TimedH11Protocol


class _OnceAMinute(logging.Filter):
    """Let asyncio's "socket.accept() out of system resource" (no file descriptor left: it retries
    every second, each time with a traceback) through once a minute: a flood of connections wrote
    427 MB of log in 50 s."""

    def __init__(self) -> None:
        super().__init__()
        self.last = -math.inf

    def filter(self, record: logging.LogRecord) -> bool:
        if "out of system resource" not in record.getMessage():
            return True
        now = time.monotonic()
        if now - self.last < 60:
            return False
        self.last = now
        return True


def stop_command(cfg: ServeConfig, url: str) -> str:
    """The command that stops this server: `rocketkv serve stop` with the --socket, --port (and
    --host) it was started with when they are not the defaults (a bare stop looks at the default
    socket only)."""
    if cfg.socket is not None:
        named = "" if cfg.socket == default_socket() else f" --socket {shlex.quote(str(cfg.socket))}"
        return f"rocketkv serve stop{named}"
    host, _, port = url.removeprefix("http://").rpartition(":")
    return f"rocketkv serve stop --port {port}" + ("" if host == "127.0.0.1" else f" --host {shlex.quote(host)}")


def _run(cfg: ServeConfig, state: ServeState, sock: socket.socket, url: str, log: Log,
         ready: Callable[[], None] = lambda: None,
         announce: Callable[[str], None] = lambda url: None) -> None:  # fmt: skip
    """uvicorn on `sock` until a shutdown request, a signal (re-raised after the shutdown:
    KeyboardInterrupt or `signals.Terminated`) or the idle timeout; logs why it stopped. `ready()`
    is called once uvicorn accepts connections; `announce(url)` as it starts serving."""
    import uvicorn

    from .app import build_app
    from .jobs import Job

    server = uvicorn.Server(uvicorn.Config(build_app(state), log_level="warning", access_log=False, lifespan="off",
                                           timeout_graceful_shutdown=3, http=_timed_protocol()))  # fmt: skip
    asyncio_log = logging.getLogger("asyncio")
    if not any(isinstance(f, _OnceAMinute) for f in asyncio_log.filters):  # once per process
        asyncio_log.addFilter(_OnceAMinute())
    why = {"reason": "shutdown request"}

    async def main() -> None:
        state.stop = asyncio.Event()

        async def watch() -> None:
            said_ready = False
            while not state.stop.is_set() and not server.should_exit:  # type: ignore[union-attr]
                await asyncio.sleep(0.2)  # (uvicorn sets should_exit on SIGINT and SIGTERM)
                if server.started and not said_ready:
                    ready()
                    said_ready = True
                idle = time.monotonic() - state.last_activity
                if cfg.idle_timeout_s and state.in_flight() == 0 and idle > cfg.idle_timeout_s:
                    why["reason"] = f"idle for {cfg.idle_timeout_s:g}s"
                    log(f"idle for {cfg.idle_timeout_s:g}s: stopping")
                    break
            server.should_exit = True
            Job.stop_all()  # answers in progress end now, each client told in one line

        watcher = asyncio.create_task(watch())
        threads = cfg.threads or f"{state.warm.current_threads} now, chosen before each request"
        log(f"serving on {url} (threads {threads}, memory budget {cfg.memory_budget / 1e9:.1f} GB, "
            f"{f'idle timeout {cfg.idle_timeout_s:g}s' if cfg.idle_timeout_s else 'no idle timeout'}); "
            f"stop with `{stop_command(cfg, url)}`")  # fmt: skip
        announce(url)
        if cfg.compile_step:
            log("--compile-step: each model's first answer compiles its decode step first (seconds: about 10 here, "
                "more on a fresh machine)")  # fmt: skip
        try:
            await server.serve(sockets=[sock])
        finally:
            watcher.cancel()

    # uvicorn stops gracefully on SIGINT and SIGTERM (answers in flight told, then the signal
    # raised again); a hangup (the terminal closed) gets the same: without this, the CLI's handler
    # raised inside the event loop, mid-request, with a traceback in the log
    hangup: list[int] = []
    previous = signal.getsignal(signal.SIGHUP)

    def on_hangup(signum: int, frame: object) -> None:
        hangup.append(signum)
        why["reason"] = "SIGHUP"
        server.should_exit = True

    if previous not in (signal.SIG_IGN, None):  # `nohup rocketkv serve` keeps running
        signal.signal(signal.SIGHUP, on_hangup)
    try:
        asyncio.run(main())
    finally:
        if previous is not None:
            signal.signal(signal.SIGHUP, previous)
    if hangup and callable(previous):
        signal.raise_signal(signal.SIGHUP)  # the CLI's handler: its exit, as after uvicorn's re-raise
    log(f"stopped ({why['reason']})")
