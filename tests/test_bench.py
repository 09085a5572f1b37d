"""`rocketkv bench` smoke test on a tiny model: runs end to end and writes the documented JSON schema."""

import json
import os
import subprocess

from conftest import text_of_bytes

ROW_KEYS = {
    "context_tokens", "ingest_s", "prefill_tokens_per_s", "file_bytes", "full_kv_bytes", "file_vs_full_kv",
    "ttft_from_file_s", "ttft_full_reprefill_s", "ttft_speedup", "decode_step_hsa_s", "decode_step_full_s",
    "decode_speedup", "decode_step_exact_pruned_s", "hsa_vs_exact_pruned", "decode_speedup_exact_pruned",
    "decode_step_exact_forward_s", "direct_step_vs_forward", "decode_step_whole_store_s",
    "working_set_vs_whole_store", "decode_step_captured_s", "captured_vs_direct",  # the tiny Llama is captured
    "weights_bytes", "hsa_kv_bytes_per_step", "ideal_decode_speedup",
    "decode_speedup_fraction_of_ideal", "budgets", "peak_rss_ask_bytes", "peak_rss_full_bytes", "peak_rss_ratio",
}  # fmt: skip


def test__bench__tiny_model_json_schema(rocketkv_bin, tiny_model_dir, tmp_path):
    source = tmp_path / "source.txt"
    source.write_text(text_of_bytes(3000))
    out = tmp_path / "bench.json"
    env = {**os.environ, "ROCKETKV_HOME": str(tmp_path / "home"), "HF_HUB_OFFLINE": "1"}
    r = subprocess.run([rocketkv_bin, "bench", "--model", str(tiny_model_dir), "--context-tokens", "300,600",
                        "--budget", "64", "--steps", "3", "--source", str(source), "--json", str(out),
                        "--crossover", "256,512", "--no-fresh-ask"],
                       capture_output=True, text=True, env=env, timeout=600)  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    report = json.loads(out.read_text())
    assert set(report) >= {"machine", "model", "device", "dtype", "config", "rows"}
    assert set(report["machine"]) >= {"torch", "transformers", "threads", "cpu", "rocketkv"}
    rows = report["rows"]
    assert [row["context_tokens"] for row in rows] == [300, 600]
    for row in rows:
        assert set(row) == ROW_KEYS
        assert row["file_bytes"] > 0 and row["peak_rss_ask_bytes"] > 0 and row["decode_step_hsa_s"] > 0
        assert row["decode_step_captured_s"] > 0 and row["captured_vs_direct"] > 0
        assert row["file_bytes"] < row["full_kv_bytes"], "at budget 64 the pruned file must be smaller than the full KV"
        assert row["hsa_kv_bytes_per_step"] < row["full_kv_bytes"] and row["ideal_decode_speedup"] > 1
    assert [c["kept_tokens"] for c in report["attention_crossover"]] == [256, 512]
    assert all(c["hsa_s"] > 0 and c["exact_s"] > 0 for c in report["attention_crossover"])
    stdout_rows = [json.loads(line) for line in r.stdout.splitlines()]
    assert [x["context_tokens"] for x in stdout_rows] == [300, 600]


def test__bench_kv_dtypes__storage_rows_side_by_side(rocketkv_bin, tiny_model_dir, tmp_path):
    source = tmp_path / "source.txt"
    source.write_text(text_of_bytes(3000))
    out = tmp_path / "bench.json"
    env = {**os.environ, "ROCKETKV_HOME": str(tmp_path / "home"), "HF_HUB_OFFLINE": "1"}
    r = subprocess.run([rocketkv_bin, "bench", "--model", str(tiny_model_dir), "--context-tokens", "400",
                        "--budget", "64", "--steps", "2", "--no-memory", "--source", str(source),
                        "--kv-dtypes", "int8,int4+hadamard", "--json", str(out), "--crossover", ""],
                       capture_output=True, text=True, env=env, timeout=600)  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    row = json.loads(out.read_text())["rows"][0]
    assert row["fresh_ask_wall_s"] > 0  # a whole `rocketkv ask` process, timed from outside
    storage = row["storage"]
    assert [s["kv_dtype"] for s in storage] == ["float32", "int8", "int4+hadamard"]
    sizes = [s["file_bytes"] for s in storage]
    assert sizes[0] > sizes[1] > sizes[2], sizes  # smaller storage, smaller file
    assert storage[0]["top1_agreement"] == 1.0 and all(0 <= s["top1_agreement"] <= 1 for s in storage)
    bad = subprocess.run([rocketkv_bin, "bench", "--model", str(tiny_model_dir), "--kv-dtypes", "int3",
                          "--source", str(source)], capture_output=True, text=True, env=env, timeout=120)  # fmt: skip
    assert bad.returncode == 2 and "--kv-dtype" in bad.stderr and "Traceback" not in bad.stderr  # a usage error


def test__bench_config__measures_the_models_own_ingest_defaults():
    """`bench` times what `ingest` runs: a preset's measured stage-1 defaults (it used to time the
    tail window with pool kernel 63 for every model), the budget it was given."""
    from rocketkv_cli.cli.bench import bench_config
    from rocketkv_cli.core.config import PrefillConfig

    smol = bench_config(PrefillConfig(token_budget=256), "smollm2-135m")
    assert (smol.observation, smol.pool_kernel_size, smol.token_budget) == ("reconstruct", 7, 256)
    other = bench_config(PrefillConfig(token_budget=512), "/models/some-llama")
    assert (other.observation, other.pool_kernel_size) == ("tail", PrefillConfig().pool_kernel_size)
    # without --budget: the preset's own token budget, as `ingest` and `ask` use it
    assert bench_config(PrefillConfig(), "smollm2-135m", budget_given=False).token_budget == 1024
    assert bench_config(PrefillConfig(), "gemma-3-270m", budget_given=False).token_budget == 1024
    assert bench_config(PrefillConfig(), "/models/some-llama", budget_given=False).token_budget == 512


def test__bench_default_lengths__capped_at_what_the_model_fits(rocketkv_bin, tiny_model_dir, tmp_path):
    """`rocketkv bench -m smollm2-135m` with no --context-tokens failed ("--context-tokens 8192
    exceeds what smollm2-135m fits (7808)"): the default lengths now stop at what the model fits,
    said on stderr; lengths given by hand are still refused past it."""
    source = tmp_path / "source.txt"
    source.write_text(text_of_bytes(12000))
    env = {**os.environ, "ROCKETKV_HOME": str(tmp_path / "home"), "HF_HUB_OFFLINE": "1"}
    common = [rocketkv_bin, "bench", "--model", str(tiny_model_dir), "--budget", "64", "--steps", "2", "--source",
              str(source), "--crossover", "", "--no-fresh-ask", "--no-memory"]  # fmt: skip
    r = subprocess.run(common, capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    (said,) = [line for line in r.stderr.splitlines() if " fits " in line and "timing" in line]
    room = int(said.split(" fits ")[1].split(" tokens")[0].replace(",", ""))
    assert room < 4096 and [json.loads(x)["context_tokens"] for x in r.stdout.splitlines()] == [room]
    given = subprocess.run([*common, "--context-tokens", "8192"], capture_output=True, text=True, env=env, timeout=600)
    assert given.returncode == 1 and "--context-tokens 8192 exceeds what" in given.stderr, given.stderr
    empty = subprocess.run([*common, "--context-tokens", ""], capture_output=True, text=True, env=env, timeout=600)
    assert empty.returncode == 2 and empty.stderr.startswith("Error: --context-tokens is empty"), empty.stderr
