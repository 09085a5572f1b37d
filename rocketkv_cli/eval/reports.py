"""The report library of scripts/ and benchmarks/: tables, intervals, resumable JSON results, timing.

Every report does the same four things around its own measurement: it renders markdown tables,
states rates and means with 95% intervals, keeps its results in a JSON file that an interrupted
run resumes from, and says how long it ran. They live here once:

    results = Results(ROOT / "docs" / "bench" / "x.json", config={"budget": 512})
    with report_timer("x"):
        for doc in docs:
            if doc.name not in results:
                results.put(doc.name, measure(doc))   # written atomically after each unit
    page = table(["doc", "hits"], [(k, rate(r["hits"], r["n"])) for k, r in results.items()])

Standard library only (the intervals come from `eval/stats.py`), so a report that only renders
kept JSON (`--from-json`) starts without torch.
"""

from __future__ import annotations

import argparse
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

__all__ = ["Results", "kept_run", "mean_interval", "rate", "read_json", "read_jsonl", "replace_section",
           "report_parser", "report_timer", "table", "write_json", "write_jsonl", "write_text"]  # fmt: skip


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


def rate(successes: int, n: int, digits: int = 2) -> str:
    """`k/n = p [lo, hi]`: a rate with its 95% Wilson interval; `-` for n = 0."""
    if n == 0:
        return "-"
    lo, hi = wilson(successes, n)
    return f"{successes}/{n} = {successes / n:.{digits}f} [{lo:.{digits}f}, {hi:.{digits}f}]"


def mean_interval(values: Sequence[float], digits: int = 3, seed: int = 0) -> str:
    """`mean [lo, hi]`: a mean with its 95% percentile-bootstrap interval (deterministic for a
    seed); `-` for no values."""
    if not values:
        return "-"
    lo, hi = bootstrap_mean(list(values), seed=seed)
    return f"{sum(values) / len(values):.{digits}f} [{lo:.{digits}f}, {hi:.{digits}f}]"


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


def write_json(path: Path, data: Any, indent: int | None = 1, end: str = "") -> Path:
    """`data` as JSON (`json.dumps` with `indent`, then `end`, e.g. a newline), written atomically."""
    return write_text(path, json.dumps(data, indent=indent) + end)


def read_json(path: Path, default: Any = None) -> Any:
    """The JSON in `path`, or `default` when there is no such file. Raises `json.JSONDecodeError`
    on a damaged file (a report must not silently start over)."""
    path = Path(path)
    return json.loads(path.read_text(encoding="utf-8")) if path.exists() else default


def write_jsonl(path: Path, rows: Iterable[Any]) -> Path:
    """One JSON object per line (non-ASCII kept), written atomically."""
    return write_text(path, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))


def read_jsonl(path: Path) -> list[Any]:
    """The objects of a JSON-lines file (blank lines skipped); [] when there is no such file."""
    path = Path(path)
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def _key(key: str | Sequence[object]) -> str:
    """A record key as stored: a string as is, a tuple such as (method, budget, sample) joined by '/'."""
    return key if isinstance(key, str) else "/".join(str(k) for k in key)


class Results:
    """A report's results, one record per unit of work, in a JSON file an interrupted run resumes from.

    The file holds `{"config": ..., "records": {key: record}}`. A key is a string or a tuple
    (e.g. `(method, budget, sample)`, stored joined by '/'). `put` rewrites the file atomically
    after each unit, so a run killed at any moment keeps every finished unit, and a rerun skips
    them (`key in results`). A file made with another `config` is not resumed from: raises
    `ValueError` naming both (delete the file, or pass the same options), unless `fresh=True`
    (start over)."""

    def __init__(self, path: Path, config: Any = None, fresh: bool = False) -> None:
        self.path = Path(path)
        self.config = config
        kept = None if fresh else read_json(self.path)
        if kept is not None and kept.get("config") != config:
            raise ValueError(f"{self.path} holds results for config {kept.get('config')!r}, not {config!r}: "
                             "delete it to start over, or rerun with the same options")  # fmt: skip
        self.records: dict[str, Any] = dict(kept["records"]) if kept else {}

    def __contains__(self, key: str | Sequence[object]) -> bool:
        return _key(key) in self.records

    def __len__(self) -> int:
        return len(self.records)

    def get(self, key: str | Sequence[object], default: Any = None) -> Any:
        """The record kept for `key`, or `default`."""
        return self.records.get(_key(key), default)

    def put(self, key: str | Sequence[object], record: Any) -> None:
        """Keep `record` for `key` and rewrite the file (atomically)."""
        self.records[_key(key)] = record
        write_json(self.path, {"config": self.config, "records": self.records})

    def todo(self, keys: Iterable[Any]) -> list[Any]:
        """The keys not measured yet, in their order: what a resumed run still has to do."""
        return [k for k in keys if k not in self]

    def items(self) -> Iterator[tuple[str, Any]]:
        """(stored key, record) pairs in the order they were first put."""
        return iter(self.records.items())


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


def report_parser(doc: str | None, smoke_help: str = "a seconds-long run on tiny inputs (CI; not evidence)"):
    """An `argparse.ArgumentParser` with the script's docstring as its description and the
    `--smoke` flag every script and benchmark has (CI runs it, so none rots unseen)."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help=smoke_help)
    return parser
