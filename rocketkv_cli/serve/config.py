"""The server's settings, checked on construction (standard library only: the CLI builds them
before torch is imported, so a bad option is refused at once)."""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from pathlib import Path

from ..errors import UsageError

DEFAULT_IDLE_TIMEOUT_S = 30 * 60.0
DEFAULT_MAX_QUEUE = 16  # requests waiting for the decode lock beyond the one answered
DEFAULT_MAX_BODY_BYTES = 1 << 20
DEFAULT_MAX_TOKENS = 4096


def memory_total_bytes() -> int:
    """The machine's memory (bytes) from /proc/meminfo, or 8 GiB where it cannot be read."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 8 << 30


def default_memory_budget() -> int:
    """Half of the machine's memory (bytes) for warm models and caches together."""
    return memory_total_bytes() // 2


def is_loopback(host: str) -> bool:
    """Whether `host` is a loopback name or address (`localhost`, 127.0.0.0/8, ::1)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def api_key_ok(key: str) -> bool:
    """Whether `key` reaches the server as it was given in an `Authorization: Bearer` header:
    printable ASCII (inner spaces and tabs too), no line break or other control character
    (http.client refuses them), no other letter (clients encode them differently: curl sends UTF-8,
    http.client Latin-1), no space at either end (HTTP drops it)."""
    return key == key.strip() and all(" " <= c <= "~" or c == "\t" for c in key)


def check_socket_path(path: str | Path) -> None:
    """Raises UsageError unless `path` names a file (a socket beside its lock file): "", "." and
    "/" name none (`--server unix:`, `--socket ""`)."""
    if Path(path).name in ("", ".", ".."):
        raise UsageError(f"socket path {str(path)!r} names no file",
                                "give a file path, e.g. unix:/tmp/rocketkv.sock")  # fmt: skip


@dataclass(frozen=True)
class ServeConfig:
    """Where and how the server listens.

    socket: a Unix socket path (mode 0600), or None for TCP on `host`:`port` (port 0: any free port).
    api_key: the Bearer token every request but /health must carry; required for a host that is not
    loopback. allow_dirs: the folders whose caches and documents may be named (resolved; None: any
    path the server's user can read — the default on a Unix socket, which only that user can open).
    idle_timeout_s: exit after this many seconds without a request (0: never). memory_budget: bytes
    of warm models and caches. max_queue: requests in flight beyond which new ones get 503.
    max_body_bytes, max_tokens_limit: per-request limits. threads: torch's threads (None: chosen
    before each job, `api.threads.default_threads`).
    trust_remote_code: whether a request may ask to run a model directory's own code (off: refused).
    compile_step: load models with their decode step compiled (`RocketKV.load(compile_step=True)`).

    Raises:
        UsageError: a value no server could take (a public host without a key, a port out of range, …).
    """

    socket: Path | None
    host: str | None
    port: int | None
    api_key: str | None
    allow_dirs: tuple[Path, ...] | None
    idle_timeout_s: float
    memory_budget: int
    threads: int | None
    max_queue: int = DEFAULT_MAX_QUEUE
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    max_tokens_limit: int = DEFAULT_MAX_TOKENS
    trust_remote_code: bool = False
    compile_step: bool = False

    def __post_init__(self) -> None:
        if (self.socket is None) == (self.host is None):
            raise UsageError("listen on a Unix socket or on --host/--port, not both")
        if self.socket is not None:
            check_socket_path(self.socket)
        if self.host is not None:
            if self.port is None or not 0 <= self.port <= 65535:
                raise UsageError(f"--port must be in 0-65535, got {self.port}")
            if not is_loopback(self.host) and not self.api_key:
                raise UsageError(f"--host {self.host} is reachable from other machines: give --api-key KEY too",
                                 "or listen on 127.0.0.1 (the default with --port)")  # fmt: skip
        if self.api_key is not None and len(self.api_key) < 8:
            raise UsageError("--api-key must be at least 8 characters")
        if self.api_key is not None and not api_key_ok(self.api_key):  # no client could ever send it
            raise UsageError("--api-key must be printable ASCII (letters, digits, punctuation, inner spaces), "
                             "with no line break and no space at either end")  # fmt: skip
        if not self.idle_timeout_s >= 0:  # NaN fails too
            raise UsageError(f"--idle-timeout must be ≥ 0 (0: never), got {self.idle_timeout_s}")
        for name in ("memory_budget", "threads", "max_queue", "max_body_bytes", "max_tokens_limit"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise UsageError(f"{name} must be ≥ 1, got {getattr(self, name)}")
        if self.allow_dirs is not None:
            missing = [str(d) for d in self.allow_dirs if not d.is_dir()]
            if missing:
                raise UsageError(f"--allow-dir {missing[0]} is not a folder")
            object.__setattr__(self, "allow_dirs", tuple(d.resolve() for d in self.allow_dirs))

    @property
    def url(self) -> str:
        return f"unix:{self.socket}" if self.socket is not None else f"http://{self.host}:{self.port}"
