"""Files written by earlier rocketkv versions still load and answer as they did.

tests/data/ holds `.kv` files of format v1 and v2 written by rocketkv 0.1.0 before the package was
reorganised, of v3 written before v4, of v4 (float16 sinks, int16 positions, line runs,
pre-RoPE keys) and of v5 (allocated key bits) (scripts/make_cache_fixtures.py, tiny random models from
fixed seeds), with the token ids each answered then with exact attention (`fixtures.json`). The
current code must read them and give the same tokens.
"""

import json
import sys
from pathlib import Path

import pytest
import torch
from conftest import make_engine

from rocketkv_cli.core.cache import CompressedKVCache, SegmentedKVCache
from rocketkv_cli.engine.answer import answer
from rocketkv_cli.store.format import load_cache

DATA = Path(__file__).resolve().parent / "data"
RECORD = json.loads((DATA / "fixtures.json").read_text())
sys.path.insert(0, str(DATA.parents[1] / "scripts"))
from make_cache_fixtures import MAX_NEW_TOKENS, QUESTIONS  # noqa: E402


@pytest.mark.parametrize("name", sorted(RECORD))
def test__old_file_loads_and_answers_as_recorded(name):
    entry = RECORD[name]
    engine = make_engine(entry["arch"], torch.float32)
    cache = load_cache(DATA / name)
    engine.check(cache.segments[0] if isinstance(cache, SegmentedKVCache) else cache, name)
    parts = cache.segments if isinstance(cache, SegmentedKVCache) else (cache,)
    assert entry.get("segmented", name.startswith("v2")) == isinstance(cache, SegmentedKVCache)
    got = [[list(a.token_ids) for a in answer(engine, p, QUESTIONS, MAX_NEW_TOKENS, None)] for p in parts]
    nested = "segmented" in entry or isinstance(cache, SegmentedKVCache)  # v1 records: one flat list
    expected = entry["answers"] if nested else [entry["answers"]]
    assert got == expected


def test__fixtures_cover_every_older_format_and_a_sliding_window_model():
    kinds = {(RECORD[n]["arch"], type(load_cache(DATA / n))) for n in RECORD}
    assert ("llama", SegmentedKVCache) in kinds and ("gemma3_text", CompressedKVCache) in kinds
    assert {n.split("-")[0] for n in RECORD} >= {"v1", "v2", "v3", "v4", "v5"}
    storages = {load_cache(DATA / n).info.storage.kv_dtype for n in RECORD if n.startswith("v3")}
    assert storages == {"int8", "int4"}
    v4 = {load_cache(DATA / n).info.storage.name for n in RECORD if n.startswith("v4")}
    assert v4 == {"int8", "int4", "int4+rope"}  # v4's sinks (default 4), and pre-RoPE keys with their frequencies
    v5 = {n: load_cache(DATA / n).info for n in RECORD if n.startswith("v5")}
    assert {i.storage.name for i in v5.values()} == {"int4+alloc"} and {i.format_version for i in v5.values()} == {5}


@pytest.mark.parametrize("name", ["v1-llama.kv", "v2-llama.kv"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), 3e38])
def test__an_old_file_with_keys_that_are_no_numbers__refused_not_answered(name, bad, tmp_path):
    """v1/v2 files were read with shapes, dtypes and positions checked, not values: NaN keys passed
    `inspect` and were answered as blank tokens. Their digests recomputed, they are refused now, as
    v3+ files are (past `MAX_STORED_ABS`)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    from rocketkv_cli.errors import CacheFormatError
    from rocketkv_cli.store.legacy import payload_digest
    from rocketkv_cli.store.metadata import metadata_digest

    with safe_open(str(DATA / name), "pt") as f:
        meta = dict(f.metadata())
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118  (safe_open has no iteration)
    key = next(k for k in sorted(tensors) if k.endswith("layers.0.keys"))
    tensors[key] = tensors[key].clone()
    tensors[key].view(-1)[:5] = bad
    meta["payload_sha256"] = payload_digest(tensors)
    meta["metadata_sha256"] = metadata_digest(meta)
    path = tmp_path / name
    save_file(tensors, str(path), metadata=meta)
    with pytest.raises(CacheFormatError):
        load_cache(path)
