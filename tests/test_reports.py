"""The report library (`rocketkv_cli/eval/reports.py`) and the smoke runs of scripts/ and benchmarks/
(each remaining script runs here in seconds, so none rots unseen), and their share of the code."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rocketkv_cli.eval.reports import (
    bootstrap_mean,
    interval,
    kept,
    kept_run,
    read_json,
    read_jsonl,
    read_text,
    replace_section,
    report_timer,
    table,
    wilson,
    write_json,
    write_jsonl,
)

ROOT = Path(__file__).resolve().parents[1]


def test__table__renders_header_rule_and_rows_and_refuses_a_short_row():
    lines = table(["task", "score"], [("a", 1), ("b|c", 0.5)], align="-r")
    assert lines == ["| task | score |", "| --- | ---: |", "| a | 1 |", "| b\\|c | 0.5 |"]
    with pytest.raises(ValueError, match="a row of 1 cells in a table of 2 columns"):
        table(["task", "score"], [("a",)])


def test__intervals__wilson_for_rates_bootstrap_for_means():
    lo, hi = wilson(8, 10)  # Wilson 95%, by hand: 0.490, 0.943
    assert interval(0.8, (lo, hi), digits=2, scale=1) == "0.80 [0.49–0.94]"
    assert interval(0.8, (lo, hi)) == "80 [49–94]" and interval(0.8, None) == "80" and interval(None) == "-"
    assert interval(0.8, (lo, hi), 3, 1, paren=True, note="10 tokens") == "0.800 (0.490–0.943, 10 tokens)"
    blo, bhi = bootstrap_mean([1.0, 2.0, 3.0, 4.0], seed=0)
    assert 1.0 <= blo < 2.5 < bhi <= 4.0 and (blo, bhi) == bootstrap_mean([1.0, 2.0, 3.0, 4.0], seed=0)


def test__json_files__written_atomically_and_read_back(tmp_path):
    path = write_json(tmp_path / "sub" / "r.json", {"a": [1, 2]}, end="\n")
    assert path.read_text() == json.dumps({"a": [1, 2]}, indent=1) + "\n" and read_json(path) == {"a": [1, 2]}
    assert read_json(tmp_path / "missing.json", {}) == {} and read_jsonl(tmp_path / "missing.jsonl") == []
    write_jsonl(tmp_path / "r.jsonl", [{"x": "é"}, {"x": 2}])
    assert read_jsonl(tmp_path / "r.jsonl") == [{"x": "é"}, {"x": 2}]
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["r.json", "r.jsonl", "sub"]  # no temporary left


def test__kept_run__runs_only_what_is_missing(tmp_path):
    out = tmp_path / "r.json"
    cmd = [sys.executable, "-c", f"open({str(out)!r}, 'w').write('[1]')"]
    assert kept_run(out, cmd) == [1]
    assert kept_run(out, [sys.executable, "-c", "raise SystemExit(3)"]) == [1]  # kept: not run again
    with pytest.raises(SystemExit, match="missing"):
        kept_run(tmp_path / "other.json", cmd, runs=False)
    with pytest.raises(SystemExit, match="exit 3"):
        kept_run(tmp_path / "other.json", [sys.executable, "-c", "raise SystemExit(3)"])


def test__kept_prose_replace_section_and_timer(tmp_path):
    old = "# T\n\nIntro line\nmore\n\n## Numbers\n\n| a |\n\n## Notes\n\n- one\n- two\n"
    assert kept(old, "Intro") == ["Intro line", "more", ""] and kept(old, "Intro", ("",)) == ["Intro line", "more"]
    assert kept(old, "## Notes", ("- two",)) == ["## Notes", "", "- one"] and kept(old, "## Missing") == []
    assert read_text(tmp_path / "none.md") == ""
    page = "# T\n\nhand\n<s>\nold\n<e>\ntail\n"
    assert replace_section(page, "<s>", "<e>", "new\n") == "# T\n\nhand\n<s>\nnew\n<e>\ntail\n"
    assert replace_section("# T\nrest", "<s>", "<e>", "x") == "# T\n\n<s>\nx\n<e>\nrest"
    err = io.StringIO()
    with report_timer("demo", err) as timing:
        pass
    assert timing["seconds"] >= 0 and err.getvalue().startswith("demo: ") and "s wall time" in err.getvalue()


def _lines(folder: str, pattern: str = "*") -> int:
    """`wc -l` of the files under `folder` (`find D -type f | xargs cat | wc -l`), caches left out."""
    files = [p for p in (ROOT / folder).rglob(pattern) if p.is_file() and "__pycache__" not in p.parts]
    return sum(p.read_bytes().count(b"\n") for p in files)


def test__scripts_and_benchmarks_stay_under_a_fifth_of_the_code():
    """Reports are thin (issue 35, by its own measure): every file of scripts/ and benchmarks/ (.py
    and .sh) under 20% of the package's .py lines (the issue's 41% was (4172 + 1023) / 12669)."""
    share = (_lines("scripts") + _lines("benchmarks")) / _lines("rocketkv_cli", "*.py")
    assert share < 0.20, f"scripts/ + benchmarks/ are {share:.1%} of the package: move shared code to eval/reports.py"


# (script, arguments, the committed page it re-renders from its committed JSON, lines that may differ)
RENDERS = [
    ("accuracy_report.py", ["--from-json", "--out-dir", "{docs}"], "accuracy.md", ()),
    ("long_documents_report.py", ["--from-json", "--out", "{page}"], "long-documents.md", ()),
    ("stage1_report.py", ["--from-json", "--out", "{page}"], "stage1-methods.md", (2,)),  # the date it ran
    ("storage_report.py", ["--from-json", "--out", "{page}"], "storage.md", ()),
    ("summary_check_report.py", ["--from-json", "--out", "{page}"], "summaries.md", ()),
]


@pytest.mark.parametrize("script, args, name, may_differ", RENDERS, ids=[r[0] for r in RENDERS])
def test__report_smoke__renders_its_committed_page_from_its_committed_json(tmp_path, script, args, name, may_differ):
    """The rendering half of each report (`--from-json`): the page it writes from docs/bench/ is
    the committed page (the measuring half needs the presets and minutes to hours)."""
    docs = tmp_path / "docs"
    docs.mkdir()
    if script == "accuracy_report.py":  # it also rewrites its merged JSON: a copy of the kept ones
        (docs / "bench").mkdir()
        for p in [*(ROOT / "docs" / "bench").glob("accuracy-*"), *(ROOT / "docs" / "bench").glob("reconstruction-*")]:
            (docs / "bench" / p.name).write_bytes(p.read_bytes())
    page = docs / name
    page.write_text((ROOT / "docs" / name).read_text())  # pages that keep hand-written parts read them here
    argv = [a.format(docs=docs, page=page) for a in args]
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / script), *argv], capture_output=True, text=True,
                       env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=120)  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    want, got = (ROOT / "docs" / name).read_text().splitlines(), page.read_text().splitlines()
    assert len(got) == len(want), (len(got), len(want))
    assert [i for i, (a, b) in enumerate(zip(want, got)) if a != b and i not in may_differ] == []


def test__decode_bench_smoke__runs_on_cpu():
    """benchmarks/decode_bench.py --smoke (a tiny Llama on CPU, ~10 s): it rotted unseen once. With a
    peak bandwidth given, each time is printed beside its floor (bytes read ÷ peak)."""
    bench = str(ROOT / "benchmarks" / "decode_bench.py")
    r = subprocess.run([sys.executable, bench, "--smoke", "--peak-gbps", "20"], capture_output=True, text=True,
                       env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=300)  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    assert "full attention (SDPA)" in r.stdout and "speedup" in r.stdout, r.stdout[-2000:]
    assert r.stdout.count("(floor ") >= 3, r.stdout[-2000:]  # the full step and each budget's


def _run(path: str, *args: str, env: dict | None = None, timeout: int = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", **(env or {})}
    return subprocess.run([sys.executable, str(ROOT / path), *args], capture_output=True, text=True, env=env,
                          timeout=timeout)  # fmt: skip


def test__make_cache_fixtures_smoke__records_the_answers_tests_data_holds(tmp_path):
    """scripts/make_cache_fixtures.py into a temporary folder (~10 s): the current version's files
    answer as tests/data/fixtures.json records."""
    r = _run("scripts/make_cache_fixtures.py", "--out", str(tmp_path))
    assert r.returncode == 0, r.stderr[-3000:]
    made, kept = read_json(tmp_path / "fixtures.json"), read_json(ROOT / "tests" / "data" / "fixtures.json")
    assert made and all((tmp_path / name).is_file() for name in made)
    assert {k: v for k, v in made.items() if k in kept} == {k: kept[k] for k in made if k in kept}


def test__answers_snapshot_smoke__records_one_ingest(tmp_path):
    """scripts/answers_snapshot.py --smoke (a tiny model's ingest through the installed CLI)."""
    out = tmp_path / "snap.jsonl"
    r = _run("scripts/answers_snapshot.py", "--smoke", "--out", str(out), "--models", str(tmp_path / "models"),
             env={"ROCKETKV_HOME": str(tmp_path / "home")})  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    (row,) = read_jsonl(out)
    assert row["case"] == "llama-ingest" and row["exit"] == 0 and row["stdout"][0]["n_segments"] == 1, row


def test__compile_check_smoke__compiles_each_kernel_once_for_sm90():
    """benchmarks/compile_check.py --smoke: each Triton kernel built once down to sm_90 on the CPU
    (~8 s; the full run, every shape and dtype, takes minutes: benchmarks/gpu_check.sh --smoke)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "compile_check.py"), "--smoke"], capture_output=True,
                       text=True, env=env, timeout=300)  # fmt: skip
    assert r.returncode == 0 and "OK: 0 failures" in r.stdout, (r.stdout[-3000:], r.stderr[-3000:])


def test__reliability_report_smoke__renders_the_first_case(tmp_path):
    """scripts/reliability_report.py --smoke (~8 s): the first case through the installed CLI, as a
    row of the page (tests/test_reliability.py asserts every case); the page's prose and its kill -9
    section (measured once by the retired scripts/kill_ingest.py) are kept as the page holds them."""
    page, want = tmp_path / "reliability.md", (ROOT / "docs" / "reliability.md").read_text()
    page.write_text(want)
    r = _run("scripts/reliability_report.py", "--smoke", "--output", str(page))
    assert r.returncode == 0, r.stderr[-3000:]
    got = page.read_text()
    rows = [line for line in got.splitlines() if line.startswith("| ") and "`rocketkv " in line]
    assert len(rows) == 1 and rows[0].endswith("| ok |") and rows[0] in want.splitlines(), rows
    assert got.split("| group |")[0] == want.split("| group |")[0]
    assert got[got.index("## kill -9") :] == want[want.index("## kill -9") :]


def test__performance_report_smoke__benches_a_tiny_model_into_the_page(tiny_model_dir, tmp_path):
    """scripts/performance_report.py --quick --model DIR --formats float32 (~15 s: one `rocketkv
    bench` run, the whole chain from the CLI to the page): the page's tables hold its row."""
    page = tmp_path / "performance.md"
    r = _run("scripts/performance_report.py", "--quick", "--model", str(tiny_model_dir), "--formats", "float32",
             "--out", str(page), env={"ROCKETKV_HOME": str(tmp_path / "home")})  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    assert (tmp_path / "bench" / f"perf-{tiny_model_dir.name}-float32.json").is_file()
    text = page.read_text()
    assert "<!-- performance-report:start -->" in text and "| float32 | 1024 |" in text, text[-2000:]
