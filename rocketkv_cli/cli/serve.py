"""`rocketkv serve`: start a warm local server (models and caches stay loaded; `ask` uses it by
itself), or show (`status`) or stop (`stop`) the running one. docs/serve.md."""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import signal
import time
from pathlib import Path
from typing import Annotated, Optional

import typer

from ..errors import InputError
from ..serve.client import (
    Server,
    ServerError,
    default_socket,
    health,
    health_after_start,
    parse_url,
    post,
    tcp_servers,
)
from ..serve.config import DEFAULT_IDLE_TIMEOUT_S, DEFAULT_MAX_QUEUE, ServeConfig, default_memory_budget
from ..signals import Terminated, handled, received
from .answers import usage_error
from .common import err, log, one_line, setup
from .options import JsonOpt, QuietOpt, ThreadsOpt, TrustOpt, path_value
from .remote import starting_said

ACTIONS = ("start", "status", "stop")


def _where(socket: Optional[Path], host: Optional[str], port: Optional[int], api_key: Optional[str]) -> Server:
    if host is not None or port is not None:
        return parse_url(f"http://{host or '127.0.0.1'}:{port or 8790}", api_key)
    return Server(path=str(socket or default_socket()), api_key=api_key)


def _none_running(where: Server, hint: str) -> ServerError:
    """ "no rocketkv server is running on URL", naming the TCP servers that do run when `where` is a
    socket (a server started with --port is found with --port too)."""
    others = tcp_servers() if where.path is not None else []
    if others:
        host, _, port = others[0].removeprefix("http://").rpartition(":")
        named = f"--port {port}" if host == "127.0.0.1" else f"--host {host} --port {port}"
        hint = f"one runs on {', '.join(others)}" + ("" if ":" in host else f": name it with {named}")  # IPv6: no
    return ServerError(f"no rocketkv server is running on {where.url}", hint)


def start_command(where: Server) -> str:
    """`rocketkv serve` with what names `where` when it is not the default socket (--socket, or
    --host/--port), so that a status's hint starts the server it asked about."""
    if where.path is not None:
        return (
            "rocketkv serve"
            if where.path == str(default_socket())
            else f"rocketkv serve --socket {shlex.quote(where.path)}"
        )
    host, port = where.host or "127.0.0.1", where.port
    if host == "127.0.0.1":
        return f"rocketkv serve --port {port}"
    return f"rocketkv serve --host {shlex.quote(host)} --port {port}"


def _status(where: Server, json_out: bool) -> None:
    info = health_after_start(where, starting_said)
    if info is None:
        raise _none_running(where, f"start one with `{start_command(where)}`")
    if json_out:
        typer.echo(json.dumps(info))
        return
    typer.echo(f"running: pid {info['pid']} on {info['url']}, threads {info['threads']}, up {info['uptime_s']:.0f}s, "
               f"{info['served']} request{'s' * (info['served'] != 1)} served, {info['active']} in flight")  # fmt: skip
    models = "; ".join(one_line(m) for m in info.get("model_descriptions") or info["models"])  # a path may hold \n
    typer.echo(f"models: {models or '-'}")
    typer.echo(f"caches: {', '.join(one_line(c) for c in info['caches']) or '-'}")
    buffers = info.get("decode_buffers_bytes", 0) / 1e6
    typer.echo(f"memory: {info['used_bytes'] / 1e6:.1f} MB of {info['memory_budget_bytes'] / 1e9:.1f} GB "
               f"(models, caches, and {buffers:.1f} MB of decode buffers)")  # fmt: skip
    if info.get("compile_step"):
        failed = info.get("compile_failure")
        typer.echo(f"decode step: compiled, {info.get('captured_steps', 0):,} steps captured"
                   + (f"; compiling failed, decoding eagerly: {failed}" if failed else ""))  # fmt: skip


def _stop(where: Server, json_out: bool = False) -> None:
    if health_after_start(where, starting_said) is None:
        raise _none_running(where, "nothing to stop")
    status, _ = post(where, "/v1/rocketkv/shutdown", {})
    if status != 200:
        raise ServerError(f"the server at {where.url} refused to stop (HTTP {status})", "check ROCKETKV_API_KEY")
    deadline = time.monotonic() + 15
    while health(where, timeout=0.5) is not None:
        if time.monotonic() > deadline:
            raise ServerError(f"the server at {where.url} is still running 15 s after it was asked to stop",
                              "it may be finishing an answer: try again, or send it SIGTERM")  # fmt: skip
        time.sleep(0.1)
    log(f"stopped the server on {where.url}")
    if json_out:
        typer.echo(json.dumps({"event": "stopped", "url": where.url}))


ActionArg = Annotated[str, typer.Argument(metavar="[start|status|stop]", help="What to do (default: start).")]
# `serve --status` and `serve --stop`, as other servers spell them: the actions, not in --help
StatusFlag = Annotated[bool, typer.Option("--status", hidden=True)]
StopFlag = Annotated[bool, typer.Option("--stop", hidden=True)]
SocketOpt = Annotated[
    Optional[Path],
    typer.Option(metavar="PATH", parser=path_value, help="Unix socket (default: $ROCKETKV_HOME/serve.sock)."),
]
HostOpt = Annotated[
    Optional[str],
    typer.Option(metavar="HOST", help="Listen on TCP instead (a host other than loopback needs --api-key)."),
]
PortOpt = Annotated[
    Optional[int], typer.Option(metavar="PORT", help="TCP port (with --host; default 8790, 0 = any free one).")
]
ApiKeyOpt = Annotated[
    Optional[str],
    typer.Option(metavar="KEY", envvar="ROCKETKV_API_KEY", show_envvar=False,
                 help="Require 'Authorization: Bearer KEY' (also $ROCKETKV_API_KEY)."),
]  # fmt: skip
AllowDirOpt = Annotated[
    Optional[list[Path]],
    typer.Option("--allow-dir", metavar="DIR", parser=path_value,
                 help="Serve caches and documents only from these folders (repeatable; TCP default: the "
                      "current folder)."),
]  # fmt: skip
IdleOpt = Annotated[
    float, typer.Option(metavar="SECONDS", help="Exit after this long without a request (0: never; at most a year).")
]
MemoryOpt = Annotated[
    Optional[float],
    typer.Option(metavar="GB", help="Memory for warm models and caches (default: half the machine's)."),
]
MAX_MEMORY_GB = 1_000_000  # a petabyte: beyond it a budget is a typo, not a machine
MAX_IDLE_TIMEOUT_S = 365 * 24 * 3600  # a year: longer is a typo for 0 (never), not a plan
CompileOpt = Annotated[
    bool,
    typer.Option(
        "--compile-step",
        help="Decode through a step compiled once "
        "(torch.compile; seconds at a model's first answer, then faster steps; docs/performance.md).",
    ),
]
QueueOpt = Annotated[int, typer.Option(min=1, metavar="N", help="Requests in flight before new ones get 503.")]


def serve_command(
    action: ActionArg = "start",
    socket: SocketOpt = None,
    host: HostOpt = None,
    port: PortOpt = None,
    api_key: ApiKeyOpt = None,
    allow_dir: AllowDirOpt = None,
    idle_timeout: IdleOpt = DEFAULT_IDLE_TIMEOUT_S,
    memory_gb: MemoryOpt = None,
    max_queue: QueueOpt = DEFAULT_MAX_QUEUE,
    threads: ThreadsOpt = None,
    trust_remote_code: TrustOpt = False,
    compile_step: CompileOpt = False,
    json_out: JsonOpt = False,
    quiet: QuietOpt = False,
    status_flag: StatusFlag = False,
    stop_flag: StopFlag = False,
) -> None:
    """Keep models and caches loaded in a local server that `ask` uses by itself.

    Listens on a Unix socket only this user can open ($ROCKETKV_HOME/serve.sock), or with --host
    on TCP. `rocketkv serve status` shows the running server, `rocketkv serve stop` stops it; it
    also exits by itself after --idle-timeout. API: docs/serve.md (OpenAI chat completions too).
    """
    if action not in ACTIONS:
        raise usage_error("ACTION", f"use start, status or stop, not {action!r}")
    flagged = [name for name, on in (("status", status_flag), ("stop", stop_flag)) if on]
    if flagged and (len(flagged) > 1 or action not in ("start", flagged[0])):  # two actions named
        named = [action, *flagged] if action != "start" else flagged
        raise usage_error("ACTION", f"give one action: {' and '.join(named)} contradict each other")
    action = flagged[0] if flagged else action
    if memory_gb is not None and not 0 < memory_gb <= MAX_MEMORY_GB:  # NaN fails both
        raise usage_error("--memory-gb", f"give the gigabytes for warm models and caches, > 0 and ≤ "
                                         f"{MAX_MEMORY_GB:,}, not {memory_gb}")  # fmt: skip
    if not 0 <= idle_timeout <= MAX_IDLE_TIMEOUT_S:  # NaN fails both
        raise usage_error("--idle-timeout", f"give seconds ≥ 0 and ≤ {MAX_IDLE_TIMEOUT_S:,} (a year; 0: never), "
                                            f"not {idle_timeout}")  # fmt: skip
    if socket is not None and (host is not None or port is not None):  # one of them was ignored
        raise usage_error("--socket", "listen on a Unix socket (--socket) or on TCP (--host/--port), not both")
    setup(quiet, threads)
    if host is None and port is not None:
        host = "127.0.0.1"
    if action != "start":
        where = _where(socket, host, port, api_key)
        _status(where, json_out) if action == "status" else _stop(where, json_out)
        return
    if socket is not None and not socket.parent.is_dir():  # made only for the default, under $ROCKETKV_HOME
        folder = one_line(str(socket.parent))
        what = f"{folder} is not a folder" if socket.parent.exists() else f"the folder {folder} does not exist"
        raise InputError(f"--socket {one_line(str(socket))}: {what}",
                         "name a socket in an existing folder, or leave --socket out (default: "
                         "$ROCKETKV_HOME/serve.sock)")  # fmt: skip
    from ..api.threads import requested_threads

    roots = tuple(allow_dir) if allow_dir else ((Path.cwd(),) if host is not None else None)
    cfg = ServeConfig(socket=None if host is not None else (socket or default_socket()), host=host,
                      port=None if host is None else (8790 if port is None else port), api_key=api_key,
                      allow_dirs=roots, idle_timeout_s=idle_timeout, threads=(requested_threads(threads) or (None,))[0],
                      memory_budget=default_memory_budget() if memory_gb is None else int(memory_gb * 1e9),
                      max_queue=max_queue, trust_remote_code=trust_remote_code,
                      compile_step=compile_step)  # fmt: skip
    from ..serve.server import serve  # torch and the model stack: only once the options are checked

    def announce(url: str) -> None:  # `--json`: where it serves, for a script that started it (--port 0)
        if json_out:
            typer.echo(json.dumps({"event": "serving", "url": url, "pid": os.getpid()}))

    try:
        serve(cfg, log, announce)
    except (KeyboardInterrupt, Terminated):  # what stops a foreground server: not an error
        signum = received()
        handled()
        with contextlib.suppress(OSError):  # a closed terminal (SIGHUP) takes no line: the exit is still 0
            if signum == signal.SIGINT and err.is_terminal:  # after the terminal's "^C", on a line of its own
                err.print()
            name = signal.Signals(signum).name if signum in (signal.SIGTERM, signal.SIGHUP) else "interrupted"
            log(f"stopped ({name})")
