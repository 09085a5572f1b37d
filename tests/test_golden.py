"""Golden: a fixed ingest + ask gives the same file bytes and the same answers as recorded.

Recorded on 9b338e8 (before the stage-1 methods moved into `rocketkv_cli/methods/`); a
refactor that changes no behaviour must leave every hash and token id as it is. Each case is one
stage-1 method (and store budget / layer budget variant) on a tiny random-init model from a fixed
seed, saved with a fixed creation time and source so that the whole file is comparable.
To re-record after an intended change of behaviour: `ROCKETKV_GOLDEN_RECORD=1 pytest tests/test_golden.py`
prints the new table (and says why in the commit).
"""

from __future__ import annotations

import hashlib
import os

import pytest
import torch
from conftest import make_engine, text_of_bytes

from rocketkv_cli.core.config import PrefillConfig
from rocketkv_cli.engine.answer import answer, decode_config_for
from rocketkv_cli.engine.inputs import Document
from rocketkv_cli.store.format import load_cache, save_cache

N_NEW = 6
QUESTIONS = ["Which word comes first?", "Where is the stone?"]
BASE = dict(token_budget=64, max_new_tokens=N_NEW, window_size=8, pool_kernel_size=5, n_first_tokens=4)
CASES = {
    "tail": {},
    "probe": {"observation": "probe"},
    "reconstruct": {"observation": "reconstruct", "pool_kernel_size": 3},
    "adaptive": {"layer_budgets": "adaptive"},
    "reselect": {"store_budget": 128},
    "sink_recent": {"selection": "sink_recent", "n_sink_tokens": 4},
}
# (arch, case) -> (sha256 of the .kv file, answer token ids per question, with the cache's stage 2)
GOLDEN: dict[str, tuple[str, list[list[int]]]] = {
    "gemma3_text/adaptive": (
        "399f9b174235782971a29a9a83c916c6d552bb6a5881146dec45efbca971f0a3",
        [[113, 172, 116, 110, 93, 157], [181, 215, 163, 215, 114, 114]],
    ),
    "gemma3_text/probe": (
        "bb2d15f7eb94a6b302cf1c613bc14c31710732eebf10ce1da63816c012469153",
        [[113, 172, 116, 110, 93, 157], [181, 215, 163, 121, 181, 215]],
    ),
    "gemma3_text/reconstruct": (
        "e4c611dba734278bf9ce540db58f193146d694477764b0cb8dba0800d8c495f2",
        [[75, 181, 157, 163, 85, 215], [181, 215, 163, 121, 181, 215]],
    ),
    "gemma3_text/reselect": (
        "e3fd277caf35bde361d4c43c1cd7893c7d34d83b6ea01e8188fb685b04b82d03",
        [[75, 181, 157, 17, 218, 93], [181, 215, 215, 114, 181, 215]],
    ),
    "gemma3_text/sink_recent": (
        "a8c3f2cb2eed6693d159723d4bedf991675f0ee9b2cc2b213e19285f3b163830",
        [[75, 181, 157, 17, 218, 17], [181, 215, 215, 114, 181, 17]],
    ),
    "gemma3_text/tail": (
        "13040f1f8d5f6a45b863b3e2e82804d396726ed5eae4ce875d15dfccbadb8a76",
        [[113, 172, 116, 110, 93, 157], [181, 215, 163, 215, 114, 114]],
    ),
    "llama/adaptive": (
        "45822e413c2e58da9c7758917bbad3a6c915ce7dfe817501f6a97b28aee4a370",
        [[206, 206, 206, 206, 206, 206], [206, 206, 206, 206, 206, 206]],
    ),
    "llama/probe": (
        "01d6158be0d25f69660b176c034d0b86768081f694bfa7bb90960b2176a28a43",
        [[206, 206, 206, 206, 206, 206], [206, 206, 206, 206, 206, 206]],
    ),
    "llama/reconstruct": (
        "1f248d31f1f3d6efe93b09d9e0a0f2d7e06c463d67df28e3e1b10a8867dc6ced",
        [[206, 206, 206, 206, 206, 206], [206, 206, 206, 206, 206, 206]],
    ),
    "llama/reselect": (
        "e0a69bc288f3be146b20b8a8c9b5824fa3313b8a4618339e84443160b83862ec",
        [[206, 206, 206, 206, 206, 206], [206, 206, 206, 206, 206, 206]],
    ),
    "llama/sink_recent": (
        "82b1a52c0894c6dd5df60266ff4d9aa0abdb8b6d675b8b25df2b348e3a4cdb60",
        [[206, 206, 206, 206, 206, 206], [206, 206, 206, 206, 206, 206]],
    ),
    "llama/tail": (
        "5a015fd50e9f655cf2bc5024ef298d626aae898cb0c932b9ed2105ada8aea591",
        [[206, 206, 206, 206, 206, 206], [206, 206, 206, 206, 206, 206]],
    ),
}


@pytest.mark.parametrize("arch", ["llama", "gemma3_text"])
@pytest.mark.parametrize("case", sorted(CASES))
def test__fixed_ingest_and_ask__same_file_bytes_and_answers(arch, case, tmp_path):
    engine = make_engine(arch, torch.float32, seed=3)
    document = Document(text=text_of_bytes(900, seed=5), sha256=f"{5:064x}", source="golden.txt")
    stored = engine.ingest(document, PrefillConfig(**{**BASE, **CASES[case]}))
    stored.info = stored.info.with_(created_at="2026-01-01T00:00:00+00:00")
    path = save_cache(stored, tmp_path / "golden.kv")
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    loaded = load_cache(path)
    answers = [list(a.token_ids) for a in answer(engine, loaded, QUESTIONS, N_NEW, decode_config_for(loaded))]
    if os.environ.get("ROCKETKV_GOLDEN_RECORD"):
        print(f'GOLDEN "{arch}/{case}": ("{digest}", {answers}),')
        return
    expected_digest, expected_answers = GOLDEN[f"{arch}/{case}"]
    assert (digest, answers) == (expected_digest, expected_answers)
