"""The report library of scripts/ and benchmarks/: tables, intervals, JSON files, resume, kept prose.

Every report does the same things around its own measurement: it renders markdown tables, states
rates and means with their 95% intervals, keeps its results in JSON files that an interrupted run
resumes from, keeps the hand-written parts of the page it rewrites, and says how long it ran.
They live here once:

    with report_timer("x"):
        report = kept_run(ROOT / "docs" / "bench" / "x.json", ["rocketkv", "eval", ..., "--json", out])
        old = read_text(page)                       # the page's hand-written parts are kept
        lines = [*kept(old, "## Design", ("## ",)), *table(["task", "score"], rows, "-r")]
        write_text(page, "\n".join(lines))         # atomic: the old page or the new one

Standard library only (the intervals come from `eval/stats.py`), so a report that only renders
kept JSON (`--from-json`) starts without torch.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from rocketkv_cli.eval.stats import bootstrap_mean, wilson

__all__ = ["bootstrap_mean", "interval", "kept", "kept_run", "read_json", "read_jsonl", "read_text", "replace_section",
           "report_timer", "table", "wilson", "write_json", "write_jsonl", "write_text"]  # fmt: skip


def table(header: Sequence[str], rows: Iterable[Sequence[object]], align: str = "") -> list[str]:
    """A markdown table as lines: the header, the rule, one line per row.

    `align` holds one letter per column (`l`, `r` or `c`; missing ones are plain `---`). Cells
    are written with `str`, a `|` inside a cell is escaped. Raises `ValueError` when a row has
    another number of cells than the header (the table would render shifted)."""
    rule = {"l": ":---", "r": "---:", "c": ":---:"}
    lines = ["| " + " | ".join(header) + " |",
             "| " + " | ".join(rule.get(align[i:i + 1], "---") for i in range(len(header))) + " |"]  # fmt: skip
    for row in rows:
        cells = [str(c).replace("|", "\\|") for c in row]
        if len(cells) != len(header):
            raise ValueError(f"a row of {len(cells)} cells in a table of {len(header)} columns: {cells}")
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def interval(value: float | None, ci: Sequence[float | None] | None = None, digits: int = 0, scale: float = 100.0,
             paren: bool = False, note: str = "") -> str:  # fmt: skip
    """`value [lo–hi]`: a rate or mean with its 95% interval `ci` (Wilson for rates, `wilson`;
    bootstrap for means, `bootstrap_mean`), each number times `scale` (100: percent) with `digits`
    decimals; `(lo–hi, note)` with `paren`. A missing number is `-`; without `ci`, the value alone."""

    def num(x: float | None) -> str:
        return "-" if x is None else f"{scale * x:.{digits}f}"

    if not ci or ci[0] is None:
        return num(value)
    inside = f"{num(ci[0])}–{num(ci[1])}" + (f", {note}" if note else "")
    return f"{num(value)} ({inside})" if paren else f"{num(value)} [{inside}]"


def write_text(path: Path, text: str) -> Path:
    """Write `text` (UTF-8) to `path` atomically: a temporary file beside it, then `os.replace`,
    so a killed report leaves the old file or the new one, never half of one. Creates the
    parent folder. Raises `OSError` when the folder cannot be written."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def write_json(path: Path, data: Any, indent: int | None = 1, end: str = "", ensure_ascii: bool = True) -> Path:
    """`data` as JSON (`json.dumps` with `indent`, `ensure_ascii`), then `end` (e.g. a newline), atomically."""
    return write_text(path, json.dumps(data, indent=indent, ensure_ascii=ensure_ascii) + end)


def read_json(path: Path, default: Any = None) -> Any:
    """The JSON in `path`, or `default` when there is no such file. Raises `json.JSONDecodeError`
    on a damaged file (a report must not silently start over)."""
    path = Path(path)
    return json.loads(path.read_text(encoding="utf-8")) if path.exists() else default


def read_text(path: Path) -> str:
    """The text (UTF-8) of `path`, or "" when there is no such file (a page not written yet)."""
    path = Path(path)
    return path.read_text(encoding="utf-8") if path.exists() else ""


def kept(page: str, start: str, stops: Sequence[str] = ("## ",)) -> list[str]:
    """The lines of `page` (a page a report rewrites) from the first one starting with `start` up
    to the next one starting with a prefix in `stops` (`""` stops at a blank line): prose written
    by hand or measured once, kept as written. [] when no line starts with `start`."""
    lines = page.splitlines()
    first = next((i for i, line in enumerate(lines) if line.startswith(start)), None)
    if first is None:
        return []
    end = next((j for j in range(first + 1, len(lines))
                if any(lines[j].startswith(p) if p else not lines[j] for p in stops)), len(lines))  # fmt: skip
    return lines[first:end]


def write_jsonl(path: Path, rows: Iterable[Any]) -> Path:
    """One JSON object per line (non-ASCII kept), written atomically."""
    return write_text(path, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))


def read_jsonl(path: Path) -> list[Any]:
    """The objects of a JSON-lines file (blank lines skipped); [] when there is no such file."""
    path = Path(path)
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def kept_run(out: Path, cmd: Sequence[str], runs: bool = True, cwd: Path | None = None) -> Any:
    """The JSON file `out` that the command `cmd` writes (e.g. `rocketkv eval ... --json out`),
    running it only when `out` is not there yet: a rerun resumes at the first missing file.

    The command is echoed to stderr (`$ rocketkv ...`) and its stdout discarded. Raises
    `SystemExit` with the next step when `runs` is False (`--from-json`) and `out` is missing,
    or when the command fails (its own error is on stderr above)."""
    out = Path(out)
    if not out.exists():
        if not runs:
            raise SystemExit(f"{out} is missing (run without --from-json to make it)")
        print("$", " ".join([Path(cmd[0]).name, *cmd[1:]]), file=sys.stderr)
        out.parent.mkdir(parents=True, exist_ok=True)
        done = subprocess.run(list(cmd), cwd=cwd, stdout=subprocess.DEVNULL)
        if done.returncode != 0:
            raise SystemExit(f"{Path(cmd[0]).name} {cmd[1]} failed (exit {done.returncode}); rerun to resume")
    return read_json(out)


def replace_section(page: str, start: str, end: str, section: str) -> str:
    """`page` with the text between the markers `start` and `end` replaced by `section` (a page
    whose hand-written parts around a generated block are kept); without the markers yet, the
    block goes after the page's first line (its title)."""
    block = f"{start}\n{section.strip()}\n{end}"
    if start in page and end in page:
        return page[: page.index(start)] + block + page[page.index(end) + len(end) :]
    title, _, rest = page.partition("\n")
    return f"{title}\n\n{block}\n{rest}"


@contextmanager
def report_timer(name: str, stream: Any = None) -> Iterator[dict[str, float]]:
    """Time a report: yields a dict whose `seconds` is set on exit, and prints
    `NAME: N s wall time` to stderr (or `stream`) even when the report fails."""
    out: dict[str, float] = {}
    start = time.perf_counter()
    try:
        yield out
    finally:
        out["seconds"] = time.perf_counter() - start
        print(f"{name}: {out['seconds']:.1f} s wall time", file=stream or sys.stderr)
