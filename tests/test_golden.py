"""Golden: a fixed ingest + ask gives the same file and the same answers as recorded.

Each case is one stage-1 method (and store budget / layer budget variant) on a tiny random-init
model from a fixed seed, saved with a fixed creation time and source so that the file is comparable.
What must stay exactly as recorded: the metadata (every key but the digests of float bytes), each
tensor's name, dtype and shape, every integer tensor (kept token positions, token ids and offsets,
line runs), and the answers' token ids. Float values
are compared as each tensor's sum of absolute values, within a relative 1e-4: float32 results differ
in their last bits between CPU families (AVX2 vs AVX-512 kernels), so whole-file bytes are not a
portable record (a file hash recorded on an AMD EPYC failed on an Intel Xeon with the same answers).
A refactor that changes no behaviour must leave all of it as it is.
To re-record after an intended change of behaviour: `ROCKETKV_GOLDEN_RECORD=1 pytest tests/test_golden.py -s`
prints the new table (and says why in the commit).
"""

from __future__ import annotations

import hashlib
import json
import os

import pytest
import torch
from conftest import make_engine, text_of_bytes
from safetensors import safe_open

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
# digests of float bytes (and of a model's float weights): they vary with the CPU, the rest must not
FLOAT_DIGESTS = {"tensors_sha256", "payload_sha256", "metadata_sha256", "model_digest"}
REL_TOL = 1e-4


def fingerprint(path) -> tuple[str, dict[str, float]]:
    """(sha256 of what must be exact, {float tensor name: sum of |x|}) of one `.kv` file."""
    exact = hashlib.sha256()
    sums: dict[str, float] = {}
    with safe_open(str(path), "pt") as f:
        meta = {k: v for k, v in (f.metadata() or {}).items() if k not in FLOAT_DIGESTS}
        exact.update(json.dumps(meta, sort_keys=True).encode())
        for name in sorted(f.keys()):
            t = f.get_tensor(name)
            exact.update(f"{name}:{t.dtype}:{tuple(t.shape)}".encode())
            if t.is_floating_point() or name.rsplit(".", 1)[-1] in ("keys", "values"):  # values or their codes
                sums[name] = float(t.double().abs().sum())
            else:  # kept positions, token ids and offsets, line runs: exact
                exact.update(t.numpy().tobytes())
    return exact.hexdigest(), sums


# (arch, case) -> (sha256 of the exact part, sum of |x| per float tensor, answer token ids per question)
GOLDEN: dict[str, tuple[str, dict[str, float], list[list[int]]]] = {
    "gemma3_text/adaptive": (
        "f8f3b210e1449f6ea9802e1264cf223b477c97316df17108508dd03318768e51",
        {
            "segments.0.layers.0.keys": 399.82701706979424,
            "segments.0.layers.0.values": 65.25938187258726,
            "segments.0.layers.1.keys": 7310.217625657911,
            "segments.0.layers.1.values": 1108.56620085569,
            "segments.0.layers.2.keys": 416.0617287941277,
            "segments.0.layers.2.values": 67.91998915972363,
            "segments.0.layers.3.keys": 7543.872992431046,
            "segments.0.layers.3.values": 1112.340388359603,
        },
        [[113, 172, 116, 110, 93, 157], [181, 215, 163, 215, 114, 114]],
    ),
    "gemma3_text/probe": (
        "de6bbc2151d53191d0dcc050d580daf31de6f5dfefc8e4a510c0f11f038fc4e7",
        {
            "segments.0.layers.0.keys": 399.82701706979424,
            "segments.0.layers.0.values": 65.25938187258726,
            "segments.0.layers.1.keys": 7374.3057262480725,
            "segments.0.layers.1.values": 1107.9055742405671,
            "segments.0.layers.2.keys": 416.0617287941277,
            "segments.0.layers.2.values": 67.91998915972363,
            "segments.0.layers.3.keys": 7438.995697591454,
            "segments.0.layers.3.values": 1105.3280627006307,
        },
        [[113, 172, 116, 110, 93, 157], [181, 215, 163, 121, 181, 215]],
    ),
    "gemma3_text/reconstruct": (
        "05dab39777d9b4eae0e6a22c41f6c831c4e44bb782b4323e1a920862c76a58d6",
        {
            "segments.0.layers.0.keys": 399.82701706979424,
            "segments.0.layers.0.values": 65.25938187258726,
            "segments.0.layers.1.keys": 7391.613983753021,
            "segments.0.layers.1.values": 1136.7310443806368,
            "segments.0.layers.2.keys": 416.0617287941277,
            "segments.0.layers.2.values": 67.91998915972363,
            "segments.0.layers.3.keys": 7436.462254629005,
            "segments.0.layers.3.values": 1099.937326640506,
        },
        [[75, 181, 157, 163, 85, 215], [181, 215, 163, 121, 181, 215]],
    ),
    "gemma3_text/reselect": (
        "13d94fd34658873be2e6ba2f6525154598273fd761706e41c7c14c66adcb2a91",
        {
            "segments.0.layers.0.keys": 399.82701706979424,
            "segments.0.layers.0.values": 65.25938187258726,
            "segments.0.layers.1.keys": 11350.571220508777,
            "segments.0.layers.1.values": 1720.2126463499126,
            "segments.0.layers.2.keys": 416.0617287941277,
            "segments.0.layers.2.values": 67.91998915972363,
            "segments.0.layers.3.keys": 11446.560980060487,
            "segments.0.layers.3.values": 1686.0715439559212,
        },
        [[75, 181, 157, 17, 218, 93], [181, 215, 215, 114, 181, 215]],
    ),
    "gemma3_text/sink_recent": (
        "ff1997f7d75157e22e52eff1580ac513c2aa9f64b64b2488a11688de2acbc9bf",
        {
            "segments.0.layers.0.keys": 399.82701706979424,
            "segments.0.layers.0.values": 65.25938187258726,
            "segments.0.layers.1.keys": 7428.679952877457,
            "segments.0.layers.1.values": 1105.6994547488903,
            "segments.0.layers.2.keys": 416.0617287941277,
            "segments.0.layers.2.values": 67.91998915972363,
            "segments.0.layers.3.keys": 7512.802876659902,
            "segments.0.layers.3.values": 1112.938601260099,
        },
        [[75, 181, 157, 17, 218, 17], [181, 215, 215, 114, 181, 17]],
    ),
    "gemma3_text/tail": (
        "070d515bef50618c3ee26575d0b3691723a635b75eebe183975341c970266ef3",
        {
            "segments.0.layers.0.keys": 399.82701706979424,
            "segments.0.layers.0.values": 65.25938187258726,
            "segments.0.layers.1.keys": 7387.4459234763635,
            "segments.0.layers.1.values": 1119.6955015890198,
            "segments.0.layers.2.keys": 416.0617287941277,
            "segments.0.layers.2.values": 67.91998915972363,
            "segments.0.layers.3.keys": 7462.73506398988,
            "segments.0.layers.3.values": 1101.389749606823,
        },
        [[113, 172, 116, 110, 93, 157], [181, 215, 163, 215, 114, 114]],
    ),
    "llama/adaptive": (
        "84dab4e9596ea58e20bd3c1a26ffaff076bd7516473385198e9ddca1772f625a",
        {
            "segments.0.layers.0.keys": 1407.9218831277103,
            "segments.0.layers.0.values": 1404.3590061629657,
            "segments.0.layers.1.keys": 1437.1941369908163,
            "segments.0.layers.1.values": 1380.5096985558994,
        },
        [[206, 206, 206, 206, 206, 206], [206, 206, 206, 206, 206, 206]],
    ),
    "llama/probe": (
        "d73dea31fcd21e183863f27bedfc1d24be4eac19eb0df7798dfd925f3e93951b",
        {
            "segments.0.layers.0.keys": 1422.458737050416,
            "segments.0.layers.0.values": 1423.1466571751516,
            "segments.0.layers.1.keys": 1433.0290538001573,
            "segments.0.layers.1.values": 1355.349305333366,
        },
        [[206, 206, 206, 206, 206, 206], [206, 206, 206, 206, 206, 206]],
    ),
    "llama/reconstruct": (
        "ea701e7358aacb93ac77cc021e37aa72f121c8426abdff55247ba14d4ca8e957",
        {
            "segments.0.layers.0.keys": 1459.1934052928118,
            "segments.0.layers.0.values": 1457.2883686847053,
            "segments.0.layers.1.keys": 1486.9063286740566,
            "segments.0.layers.1.values": 1374.3867541942163,
        },
        [[206, 206, 206, 206, 206, 206], [206, 206, 206, 206, 206, 206]],
    ),
    "llama/reselect": (
        "68a8dcc56831ef04adf5692e7fca2e4815eb9cb6868899dd6174c5cf389d1dcb",
        {
            "segments.0.layers.0.keys": 2177.771974214178,
            "segments.0.layers.0.values": 2190.574168035353,
            "segments.0.layers.1.keys": 2169.122898657224,
            "segments.0.layers.1.values": 2101.073279856908,
        },
        [[206, 206, 206, 206, 206, 206], [206, 206, 206, 206, 206, 206]],
    ),
    "llama/sink_recent": (
        "1dd930e09fc24f4b7f0c7427138ad025288cc0c19f405a7b971d223c669e890a",
        {
            "segments.0.layers.0.keys": 1407.453894589882,
            "segments.0.layers.0.values": 1434.2257353060995,
            "segments.0.layers.1.keys": 1438.0795308339875,
            "segments.0.layers.1.values": 1394.2844350715823,
        },
        [[206, 206, 206, 206, 206, 206], [206, 206, 206, 206, 206, 206]],
    ),
    "llama/tail": (
        "ead4394d73ae430d5b96a37480013f098b5997a8b70f90b3c2a15f2365982c1d",
        {
            "segments.0.layers.0.keys": 1429.9476168938563,
            "segments.0.layers.0.values": 1425.803344775457,
            "segments.0.layers.1.keys": 1417.2554070776096,
            "segments.0.layers.1.values": 1359.7193734695102,
        },
        [[206, 206, 206, 206, 206, 206], [206, 206, 206, 206, 206, 206]],
    ),
}


@pytest.mark.parametrize("arch", ["llama", "gemma3_text"])
@pytest.mark.parametrize("case", sorted(CASES))
def test__fixed_ingest_and_ask__same_file_and_answers(arch, case, tmp_path):
    engine = make_engine(arch, torch.float32, seed=3)
    document = Document(text=text_of_bytes(900, seed=5), sha256=f"{5:064x}", source="golden.txt")
    stored = engine.ingest(document, PrefillConfig(**{**BASE, **CASES[case]}))
    stored.info = stored.info.with_(created_at="2026-01-01T00:00:00+00:00")
    path = save_cache(stored, tmp_path / "golden.kv")
    digest, sums = fingerprint(path)
    loaded = load_cache(path)
    answers = [list(a.token_ids) for a in answer(engine, loaded, QUESTIONS, N_NEW, decode_config_for(loaded))]
    if os.environ.get("ROCKETKV_GOLDEN_RECORD"):
        print(f'GOLDEN "{arch}/{case}": ("{digest}", {sums!r}, {answers}),')
        return
    expected_digest, expected_sums, expected_answers = GOLDEN[f"{arch}/{case}"]
    assert (digest, answers) == (expected_digest, expected_answers)
    assert sums.keys() == expected_sums.keys()
    far = {k: (sums[k], v) for k, v in expected_sums.items() if abs(sums[k] - v) > REL_TOL * max(abs(v), 1e-12)}
    assert not far, f"float tensors off by more than {REL_TOL:g} relative (got, recorded): {far}"
