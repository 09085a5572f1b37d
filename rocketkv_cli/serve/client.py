"""The client side of `rocketkv serve`: find a running server and talk to it. Standard library
only (`http.client` over a Unix domain socket or TCP), so that a command answered by a warm
server never imports torch or transformers: `rocketkv ask` with a server running starts in a
fraction of a second.

Where the server is (`locate`): `--server URL` (`unix:/path/to/socket` or `http://host:port`),
else `$ROCKETKV_SERVER`, else the default socket `$ROCKETKV_HOME/serve.sock` when a server answers
there. A socket file that nobody listens on (left by a killed server) counts as no server; a
server still starting there (its lock file says so, `starting_pid`) is waited for.
The API key for a TCP server comes from `$ROCKETKV_API_KEY`.

The native protocol (`POST /v1/rocketkv/ask`): a JSON body, and a response of newline-delimited
JSON events, one per line (docs/serve.md): `{"event": "piece", "text": ...}` while an answer is
decoded, `{"event": "answer", "record": {...}}` when it is done, `{"event": "log", ...}`,
`{"event": "error", "type": ..., "message": ..., "hint": ...}`, and `{"event": "done"}` last. An
error is re-raised here as the same `rocketkv_cli.errors` type, so the command prints the same
one line and exits with the same code as it would without a server.
"""

from __future__ import annotations

import http.client
import json
import os
import re
import socket
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from .. import __version__, errors
from ..errors import InputError, RocketKVError
from .config import DEFAULT_MAX_BODY_BYTES, api_key_ok, check_socket_path

SOCKET_NAME = "serve.sock"
HEALTH_TIMEOUT_S = 2.0  # a warm server answers /health in milliseconds; a busy one still answers (async)
MAX_QUESTIONS = 1000  # per request; `ask` with more answers in its own process
SMALL_REQUEST_BYTES = 64 * 1024  # a request body under this fits any server: sent without asking its limit
REQUEST_MARGIN_BYTES = 32 * 1024  # the fields a request adds to what `fits` is given (paths, options), at most
BUSY_WAIT_S = 600.0  # how long a client waits for a busy server (503) before it reports it
UNIX_PATH_MAX = 107  # bytes in sockaddr_un.sun_path, less the terminating NUL (Linux)
STARTING_WAIT_S = 120.0  # how long a client waits for a server that is starting (its imports: seconds)
LOCK_STARTING, LOCK_READY = "starting", "ready"  # what a server's lock file says after its pid
TCP_SERVERS = "tcp-servers"  # $ROCKETKV_HOME/tcp-servers/PID: the URL of each TCP server running, then its state


def home() -> Path:
    """`$ROCKETKV_HOME` or `~/.cache/rocketkv` (as `model.loading.rocketkv_home`, torch-free)."""
    env = os.environ.get("ROCKETKV_HOME")
    return Path(env) if env else Path.home() / ".cache" / "rocketkv"


def default_socket() -> Path:
    """The default server socket: `$ROCKETKV_HOME/serve.sock`."""
    return home() / SOCKET_NAME


class ServerError(RocketKVError):
    """The server could not be reached, answered something that is not rocketkv's protocol, or
    stopped before the answer was complete."""


@dataclass(frozen=True)
class Server:
    """Where a server listens: a Unix socket `path`, or TCP `host`:`port`; `api_key`: the Bearer
    token sent with every request (None: none)."""

    path: str | None = None
    host: str | None = None
    port: int | None = None
    api_key: str | None = None

    def __post_init__(self) -> None:
        if (self.path is None) == (self.host is None):
            raise ValueError("a server is a socket path or a host, not both")
        if self.path is not None:
            check_socket_path(self.path)
        if self.api_key and not api_key_ok(self.api_key):
            raise InputError("ROCKETKV_API_KEY holds characters an HTTP header cannot carry as given (a line "
                             "break, a letter outside ASCII, a space at either end)",
                             "set it to the server's --api-key")  # fmt: skip
        if self.path is not None and len(os.fsencode(self.path)) > UNIX_PATH_MAX:
            raise InputError(f"socket path {self.path} is longer than {UNIX_PATH_MAX} bytes",
                             "use a shorter path (the default socket is in $ROCKETKV_HOME)")  # fmt: skip

    @property
    def url(self) -> str:
        return f"unix:{self.path}" if self.path is not None else f"http://{self.host}:{self.port}"

    def connection(self, timeout: float | None) -> http.client.HTTPConnection:
        if self.path is not None:
            return _UnixConnection(self.path, timeout)
        assert self.host is not None and self.port is not None  # __post_init__: one of the two
        return http.client.HTTPConnection(self.host, self.port, timeout=timeout)

    def headers(self) -> dict[str, str]:
        # X-RocketKV-Events: this client shows `status` events (a model loading there: a spinner)
        base = {"Content-Type": "application/json", "Accept": "application/x-ndjson", "X-RocketKV-Events": "status"}
        if self.api_key:
            base["Authorization"] = f"Bearer {self.api_key}"
        return base


class _UnixConnection(http.client.HTTPConnection):
    """HTTP over a Unix domain socket (the Host header says `localhost`)."""

    def __init__(self, path: str, timeout: float | None):
        super().__init__("localhost", timeout=timeout)
        self.unix_path = path

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        try:
            sock.connect(self.unix_path)
        except OSError:
            sock.close()
            raise
        self.sock = sock


def parse_url(url: str, api_key: str | None = None) -> Server:
    """`unix:/path`, a bare socket path, or `http://host:port` as a `Server`. Raises UsageError."""
    if url.startswith("unix:"):
        return Server(path=url.removeprefix("unix:"), api_key=api_key)
    if url.startswith("/") or url.startswith("."):
        return Server(path=url, api_key=api_key)
    try:
        parts = urlsplit(url)
        hostname = parts.hostname
    except ValueError:  # e.g. an unclosed IPv6 bracket
        raise errors.UsageError(f"--server {url}: not a URL; give unix:/path/to/socket or http://host:port") from None
    if parts.scheme != "http" or not hostname or parts.path not in ("", "/"):
        raise errors.UsageError(f"--server {url}: give unix:/path/to/socket or http://host:port")
    if parts.query or parts.fragment or "@" in parts.netloc:  # never sent: not silently dropped either
        raise errors.UsageError(f"--server {url}: give http://host:port alone (no user, query or fragment; "
                                "the API key comes from $ROCKETKV_API_KEY)")  # fmt: skip
    try:
        port = 80 if parts.port is None else parts.port
    except ValueError:
        port = 0
    if not 1 <= port <= 65535:  # `:0` was port 80
        raise errors.UsageError(f"--server {url}: the port is not a number in 1-65535")
    return Server(host=hostname, port=port, api_key=api_key)


def health(server: Server, timeout: float = HEALTH_TIMEOUT_S) -> dict | None:
    """The server's `/health` object, or None when nothing answers there (no socket, connection
    refused: a stale socket of a killed server, a time-out)."""
    conn = server.connection(timeout)
    try:
        conn.request("GET", "/health", headers=server.headers())
        response = conn.getresponse()
        body = response.read()
    except (OSError, http.client.HTTPException):
        return None
    finally:
        conn.close()
    try:
        data = json.loads(body)
    except ValueError:
        return None
    return data if response.status == 200 and isinstance(data, dict) and data.get("service") == "rocketkv" else None


def locate(url: str | None, no_server: bool,
           waiting: Callable[[int], AbstractContextManager] | None = None) -> Server | None:  # fmt: skip
    """The server to use, or None (answer in this process).

    `no_server`: None. `url` (or `$ROCKETKV_SERVER`): that server, which must answer (raises
    ServerError otherwise: the user asked for it). Otherwise the default socket when a server
    answers on it; None when there is none or it is stale (a killed server's socket file). A server
    still starting there (`starting_pid`) is waited for with the context `waiting(pid)` held (the
    CLI shows a spinner); without `waiting` it is returned at once (its requests wait in the
    socket's backlog until it serves)."""
    if no_server:
        return None
    api_key = os.environ.get("ROCKETKV_API_KEY") or None
    named = url or os.environ.get("ROCKETKV_SERVER") or None
    if named:
        try:
            server = parse_url(named, api_key)
        except errors.UsageError as exc:  # name where the URL came from: the option or the environment
            if url:
                raise
            raise errors.UsageError(exc.message.replace("--server ", "$ROCKETKV_SERVER=", 1), exc.hint) from None
        if health_after_start(server, waiting) is None:  # `rocketkv serve --socket S &` a moment ago: waited for
            where = "" if url else " ($ROCKETKV_SERVER)"
            instead = "answer here without --server" if url else "unset $ROCKETKV_SERVER, or pass --no-server"
            raise ServerError(f"no rocketkv server answers at {server.url}{where}",
                              f"start one with `rocketkv serve`, or {instead}")  # fmt: skip
        return server
    path = default_socket()
    if len(os.fsencode(str(path))) > UNIX_PATH_MAX:  # no server can listen there (`serve` says why): answer here
        return None
    server = Server(path=str(path), api_key=api_key)
    found = _on_default_socket(server, waiting)
    if found is None and (launched := launching_pid()) is not None:
        _wait_for_lock(path, launched)  # `rocketkv serve & rocketkv ask …`: the server is not at its lock yet
        found = _on_default_socket(server, waiting)
    return found


def _on_default_socket(server: Server, waiting: Callable[[int], AbstractContextManager] | None) -> Server | None:
    """`server` (the default socket) when a server of this version answers there or is starting
    there (waited for as `locate` says); else None."""
    assert server.path is not None  # the default socket
    path = Path(server.path)
    if starting_pid(path) is None:
        try:
            if os.stat(path).st_uid != os.getuid():  # another user's socket: never send them our questions
                return None
        except OSError:
            return None
    elif waiting is None:  # `rocketkv serve &` a moment ago: its socket is bound, torch still importing
        return server if _listening(path) == "listening" else None
    info = health_after_start(server, waiting)
    if info is None or info.get("version") != __version__:  # an older server left running: answer here
        return None
    return server


def tcp_servers() -> list[str]:
    """The URLs of this user's TCP servers still running (`server.list_tcp_server`), by pid."""
    return [url for _, url, _ in _listed_tcp_servers()]


def tcp_starting_pid(server: Server) -> int | None:
    """The pid of a live TCP server of this user listening at `server`'s host and port that is
    still starting, as its `tcp-servers/PID` file says; else None."""
    for pid, url, state in _listed_tcp_servers():
        if state == LOCK_STARTING and url == f"http://{_loopback(server.host)}:{server.port}":
            return pid
    return None


def _loopback(host: str | None) -> str | None:
    """`localhost` as the address a server started with the default --host lists."""
    return "127.0.0.1" if host == "localhost" else host


def _listed_tcp_servers() -> list[tuple[int, str, str]]:
    """(pid, URL, state) of each TCP server `server.list_tcp_server` noted whose process lives."""
    found = []
    try:
        entries = sorted((home() / TCP_SERVERS).iterdir(), key=lambda p: p.name)
    except OSError:
        return []
    for entry in entries:
        if entry.name.isdigit() and _alive(int(entry.name)):
            try:
                url, _, state = entry.read_text().strip().partition("\n")
            except OSError:
                continue
            if re.fullmatch(r"http://\S+:\d+", url):  # one being written, or damaged: not named
                found.append((int(entry.name), url, state.strip() or LOCK_READY))
    return found


def _alive(pid: int) -> bool:
    """Whether process `pid` exists and is this user's (another user's reused pid is not our server)."""
    try:
        os.kill(pid, 0)  # no signal sent: whether the process exists
    except (ProcessLookupError, PermissionError):
        return False
    return True


LAUNCH_WINDOW_S = 3.0  # seconds: a `rocketkv serve` younger than this may not have taken its lock yet


def process_age_s(pid: int | str = "self") -> float | None:
    """Seconds since process `pid` started (Linux `/proc`), or None where that is unknown (another
    system, a process gone)."""
    try:
        start_ticks = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        return uptime - start_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def launching_pid() -> int | None:
    """A `rocketkv serve` of this user, for the default socket of this `$ROCKETKV_HOME` (no
    `--socket`, `--host`, `--port`; not `status` or `stop`), started under `LAUNCH_WINDOW_S`
    seconds ago: it may not have reached its lock (the CLI's imports take as long as this
    client's). Read from Linux's /proc; None elsewhere, or when there is none."""
    try:
        pids = [int(name) for name in os.listdir("/proc") if name.isdigit() and int(name) != os.getpid()]
    except OSError:
        return None
    ours = (os.environ.get("ROCKETKV_HOME") or None, os.environ.get("HOME"))
    for pid in pids:
        try:
            if os.stat(f"/proc/{pid}").st_uid != os.getuid():
                continue
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            if not _serves_default_socket([os.fsdecode(a) for a in argv]):
                continue
            age = process_age_s(pid)
            environ = dict(
                e.split(b"=", 1) for e in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0") if b"=" in e
            )
        except (OSError, ValueError, IndexError):  # gone meanwhile, or not readable
            continue
        theirs = tuple((os.fsdecode(v) or None) if (v := environ.get(k)) is not None else None
                       for k in (b"ROCKETKV_HOME", b"HOME"))  # fmt: skip
        if age is not None and age < LAUNCH_WINDOW_S and theirs == ours:
            return pid
    return None


def _serves_default_socket(argv: list[str]) -> bool:
    """Whether a command line is `rocketkv serve [start] [options]` on the default socket: the
    console script (run directly or by an interpreter) or `python -m rocketkv_cli`, not a command
    that names it (`man rocketkv serve`)."""
    for i, arg in enumerate(argv[:-1]):
        script = os.path.basename(arg) == "rocketkv" and (i == 0 or (i == 1 and "python" in os.path.basename(argv[0])))
        module = arg == "rocketkv_cli" and i >= 1 and argv[i - 1] == "-m"
        if (script or module) and argv[i + 1] == "serve":
            rest = argv[i + 2 :]
            return not any(a in ("status", "stop") or a.startswith(("--socket", "--host", "--port", "-h", "--help"))
                           for a in rest)  # fmt: skip
    return False


def _wait_for_lock(path: Path, pid: int, timeout: float = LAUNCH_WINDOW_S) -> None:
    """Until the launching server `pid` has written its pid in the lock of `path` (a killed
    server's lock file and socket may be there before it), or has ended; `timeout` at most."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and _alive(pid):
        if (_lock_words(path) or [""])[0] == str(pid):
            return
        time.sleep(0.02)


def _lock_words(path: Path) -> list[str] | None:
    """The words of the lock file `<path>.lock` ("PID STATE", `server.py`), when it is this user's
    and not a link; None when there is none such."""
    try:
        fd = os.open(path.with_name(path.name + ".lock"), os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return None
    try:
        return os.read(fd, 64).decode("ascii", "replace").split() if os.fstat(fd).st_uid == os.getuid() else None
    except OSError:
        return None
    finally:
        os.close(fd)


def starting_pid(path: Path) -> int | None:
    """The pid of a live server of this user that has bound the socket at `path` and is still
    starting (importing torch, seconds), as its lock file `<path>.lock` says ("PID starting"); else
    None (no lock file, another user's, a server serving already, or its process gone)."""
    said = _lock_words(path)
    if said is None or len(said) != 2 or said[1] != LOCK_STARTING or not said[0].isdigit():
        return None
    pid = int(said[0])
    return pid if _alive(pid) else None  # one killed while it started: its lock is free, the socket stale


def health_after_start(server: Server, waiting: Callable[[int], AbstractContextManager] | None) -> dict | None:
    """`health(server)`; for a server still starting (`starting_pid`, `tcp_starting_pid`), once it
    serves, with the context `waiting(pid)` held meanwhile (`wait_started`; without `waiting`, no
    wait)."""
    pid = starting_pid(Path(server.path)) if server.path is not None else tcp_starting_pid(server)
    if pid is None or waiting is None:
        return health(server)
    with waiting(pid):
        return wait_started(server, pid)


def wait_started(server: Server, pid: int, timeout: float = STARTING_WAIT_S) -> dict | None:
    """`/health` of a server that is starting (`starting_pid`, `tcp_starting_pid`), once it answers; None when its
    process ends first, or its lock names it but nothing is bound or listening there (a lock left
    by a server stopped while it started). Raises ServerError when it is still starting after
    `timeout` seconds (answering beside its imports is what waiting avoids)."""
    deadline, missing_since = time.monotonic() + timeout, None
    while time.monotonic() < deadline:
        info = health(server, timeout=1.0)  # connections wait in the socket's backlog until it serves
        if server.path is None:  # TCP: bound before it was listed starting
            if info is not None or tcp_starting_pid(server) != pid:
                return info or health(server)
            if _refused(server):  # nobody listens there: a listing left saying "starting" (its pid reused)
                return None
            time.sleep(0.1)
            continue
        path = Path(server.path)
        if info is not None or starting_pid(path) != pid:
            return info or health(server)
        state = _listening(path)
        if state == "refused":  # a socket file nobody listens on: stale, whatever the lock says
            return None
        missing_since = None if state != "missing" else (missing_since or time.monotonic())
        if missing_since is not None and time.monotonic() - missing_since > 3.0:  # it binds right after its lock
            return None
        time.sleep(0.1)
    raise ServerError(f"the rocketkv server (pid {pid}) on {server.url} is still starting after {timeout:.0f} s",
                      "wait and run the command again, or pass --no-server")  # fmt: skip


def _refused(server: Server) -> bool:
    """Whether a TCP connection to `server` is refused (nothing listens on its port)."""
    try:
        socket.create_connection((str(server.host), int(server.port or 0)), timeout=0.5).close()
    except ConnectionRefusedError:
        return True
    except OSError:  # a time-out, a full backlog: something may be there
        return False
    return False


def _listening(path: Path) -> str:
    """ "listening" (a connection is taken, if only into the backlog), "refused" (a socket file no
    process listens on) or "missing" (no socket file yet)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(0.5)
    try:
        sock.connect(str(path))
    except (FileNotFoundError, NotADirectoryError):
        return "missing"
    except ConnectionRefusedError:
        return "refused"
    except OSError:
        return "listening"  # a full backlog, a time-out: something is there
    finally:
        sock.close()
    return "listening"


def fits(server: Server, payload: dict) -> bool:
    """Whether a request carrying `payload` (its questions, a document's text), with the fields a
    request adds to it (`REQUEST_MARGIN_BYTES`), is within the server's body limit (`/health`'s
    `max_body_bytes`; a server that does not say has the default, 1 MiB). A command whose request
    does not fit answers in its own process, as the same command does without a server."""
    size = len(json.dumps(payload).encode()) + REQUEST_MARGIN_BYTES
    if size <= SMALL_REQUEST_BYTES:
        return True
    limit = (health(server) or {}).get("max_body_bytes", DEFAULT_MAX_BODY_BYTES)
    return isinstance(limit, int) and size <= limit


def _raise_error(event: dict) -> None:
    """Re-raise an error event as its `rocketkv_cli.errors` type (RocketKVError if unknown)."""
    kind = getattr(errors, str(event.get("type", "")), None)
    if not (isinstance(kind, type) and issubclass(kind, RocketKVError)):
        kind = RocketKVError
    raise kind(str(event.get("message", "the server failed")), event.get("hint") or None)


def _error_body(status: int, body: bytes) -> dict:
    try:
        data = json.loads(body)
        if isinstance(data, dict) and isinstance(data.get("error"), dict):
            return data["error"]
    except ValueError:
        pass
    return {"type": "ServerError", "message": f"the server answered HTTP {status}"}


def _retry_after(value: str | None) -> float:
    """Seconds to wait from a Retry-After header (1 s when absent or not a number; at most 10 s)."""
    try:
        return min(10.0, max(0.1, float(value or 1)))
    except ValueError:
        return 1.0


def _lost(server: Server) -> ServerError:
    return ServerError(f"the rocketkv server at {server.url} stopped before the answer was complete",
                       "run the command again (with --no-server to answer without it)")  # fmt: skip


def _foreign(server: Server) -> ServerError:
    return ServerError(f"the server at {server.url} answered something that is not rocketkv's protocol",
                       "check --server / $ROCKETKV_SERVER, or pass --no-server")  # fmt: skip


def answer_record(server: Server, event: dict) -> dict:
    """The `record` of an `answer` event, checked: a JSON object with the answer's text, its
    timings (seconds), token count and stop reason, and `citations` (when the event has them) a
    list of objects. Raises ServerError otherwise (a server that is not rocketkv's, or a damaged
    stream: never an empty answer printed as if it were one)."""
    record, citations = event.get("record"), event.get("citations")
    number = (int, float)
    fields = {"answer": str, "stop_reason": str, "n_answer_tokens": int, "prefill_s": number, "decode_s": number}
    listed = citations is None or (isinstance(citations, list) and all(isinstance(c, dict) for c in citations))
    if not isinstance(record, dict) or not listed:
        raise _foreign(server)
    for name, kind in fields.items():
        value = record.get(name)
        if not isinstance(value, kind) or isinstance(value, bool):  # type: ignore[arg-type]
            raise _foreign(server)
    return record


def _send(server: Server, path: str, body: dict) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
    """POST `body`; while the server answers 503 (busy), wait as Retry-After says and send again, up to
    BUSY_WAIT_S (in the process the question would have waited for the cores too). Raises ServerError."""
    deadline = time.monotonic() + BUSY_WAIT_S
    while True:
        try:
            conn = server.connection(timeout=None)  # an answer may take long; a dead server closes the socket
            conn.request("POST", path, body=json.dumps(body).encode(), headers=server.headers())
        except (OSError, http.client.HTTPException) as exc:
            raise ServerError(f"cannot reach the rocketkv server at {server.url}: {exc}",
                              "start it again with `rocketkv serve`, or pass --no-server") from None  # fmt: skip
        try:
            response = conn.getresponse()  # the server has the request: a failure from here on is a lost answer
        except (OSError, http.client.HTTPException):
            conn.close()
            raise _lost(server) from None
        busy = response.status == 503 and response.getheader("Retry-After") is not None  # not a server stopping
        if not busy or time.monotonic() > deadline:
            return conn, response
        response.read()
        conn.close()
        time.sleep(_retry_after(response.getheader("Retry-After")))


def events(server: Server, path: str, body: dict) -> Iterator[dict]:
    """POST `body` to `path` and yield the response's NDJSON events until `done` (not yielded).

    Raises:
        the error event's type (InputError, CacheFormatError, ...) for an error the server reports;
        ServerError when the connection fails or ends before `done` (a server killed mid-answer).
    """
    conn, response = _send(server, path, body)
    try:
        if response.status != 200:
            error = _error_body(response.status, response.read())
            error.setdefault("type", "ServerError")
            _raise_error(error)
        while True:
            line = response.readline()
            if not line:
                break
            event = json.loads(line)
            if not isinstance(event, dict):
                raise _foreign(server)
            if event.get("event") == "done":
                return
            if event.get("event") == "error":
                _raise_error(event)
            yield event
    except (OSError, http.client.HTTPException, ValueError):
        pass  # the connection broke or the stream is cut: reported below
    finally:
        conn.close()
    raise _lost(server)


def get(server: Server, path: str, timeout: float = HEALTH_TIMEOUT_S) -> tuple[int, dict]:
    """GET `path`: (HTTP status, JSON object). Raises ServerError when nothing answers."""
    return _simple(server, "GET", path, None, timeout)


def post(server: Server, path: str, body: dict, timeout: float = HEALTH_TIMEOUT_S) -> tuple[int, dict]:
    """POST a JSON `body` to `path`: (HTTP status, JSON object). Raises ServerError when nothing answers."""
    return _simple(server, "POST", path, body, timeout)


def _simple(server: Server, method: str, path: str, body: dict | None, timeout: float) -> tuple[int, dict]:
    conn = server.connection(timeout)
    try:
        conn.request(method, path, body=None if body is None else json.dumps(body).encode(), headers=server.headers())
        response = conn.getresponse()
        raw = response.read()
    except (OSError, http.client.HTTPException) as exc:
        raise ServerError(f"cannot reach the rocketkv server at {server.url}: {exc}") from None
    finally:
        conn.close()
    try:
        data = json.loads(raw)
    except ValueError:
        data = {}
    return response.status, data if isinstance(data, dict) else {}
