"""Golden: a fixed ingest + ask gives the same file and the same answers as recorded.

Each case is one stage-1 method (and store budget / layer budget variant) on a tiny random-init
model from a fixed seed, saved with a fixed creation time and source so that the file is comparable.
What must stay exactly as recorded: the metadata (every key but the digests of float bytes), each
tensor's name, dtype and shape, every integer tensor (kept token positions, token ids and offsets,
line runs), and the answers' token ids. Float values (and quantized codes) are compared as each
tensor's Σ|x| and a weighted Σ x·w, within 1e-4 of Σ|x|: float32 results differ
in their last bits between CPU families (AVX2 vs AVX-512 kernels), so whole-file bytes are not a
portable record (a file hash recorded on an AMD EPYC failed on an Intel Xeon with the same answers).
A refactor that changes no behaviour must leave all of it as it is. (The kept positions and answer
tokens come from top-k and argmax over float scores: a near tie could still differ between CPUs;
none did between the two machines above.)
To re-record after an intended change of behaviour: `ROCKETKV_GOLDEN_RECORD=1 pytest -n 0 -s tests/test_golden.py`
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
# digests of float bytes (and of a model's float weights): they vary with the CPU, the rest must not;
# `tensors_sha256` digests the tensor table (names, dtypes, shapes, byte offsets) and stays
FLOAT_DIGESTS = {"payload_sha256", "metadata_sha256", "model_digest"}
SEGMENT_FLOAT_DIGESTS = {"kv_sha256"}  # per segment, in the `segments` metadata: its keys' and values' bytes
REL_TOL = 1e-4


def fingerprint(path) -> tuple[str, dict[str, list[float]]]:
    """(sha256 of what must be exact, {float tensor name: [Σ|x|, Σ x·w]}) of one `.kv` file, with w
    fixed weights from -1 to 1 along the flattened tensor (so a sign flip or a permutation shows)."""
    exact = hashlib.sha256()
    sums: dict[str, list[float]] = {}
    with safe_open(str(path), "pt") as f:
        meta = {k: v for k, v in (f.metadata() or {}).items() if k not in FLOAT_DIGESTS}
        if "segments" in meta:
            entries = [
                {k: v for k, v in e.items() if k not in SEGMENT_FLOAT_DIGESTS} for e in json.loads(meta["segments"])
            ]
            meta["segments"] = json.dumps(entries, sort_keys=True)
        exact.update(json.dumps(meta, sort_keys=True).encode())
        for name in sorted(f.keys()):
            t = f.get_tensor(name)
            exact.update(f"{name}:{t.dtype}:{tuple(t.shape)}".encode())
            # values, or their quantized codes and bit widths (which rounding decides): compared within a tolerance
            if t.is_floating_point() or name.rsplit(".", 1)[-1] in ("keys", "values", "q", "bits"):
                x = t.double().reshape(-1)
                w = torch.linspace(-1, 1, x.numel(), dtype=torch.float64)
                sums[name] = [float(x.abs().sum()), float((x * w).sum())]
            else:  # kept positions, token ids and offsets, line runs: exact
                exact.update(t.numpy().tobytes())
    return exact.hexdigest(), sums


# (arch, case) -> (sha256 of the exact part, sum of |x| per float tensor, answer token ids per question)
GOLDEN: dict[str, tuple[str, dict[str, list[float]], list[list[int]]]] = {
    "gemma3_text/adaptive": (
        "a2516ab95aa59f556987a045317582cbe19f20682fa13e9932b19e64babdd758",
        {
            "segments.0.layers.0.keys": [399.82701706979424, 20.335802676722977],
            "segments.0.layers.0.values": [65.25938187258726, -0.722723244910304],
            "segments.0.layers.1.keys": [7310.217625657911, -32.57401611244009],
            "segments.0.layers.1.values": [1108.56620085569, 18.63028742961157],
            "segments.0.layers.2.keys": [416.0617287941277, -13.874161644946291],
            "segments.0.layers.2.values": [67.91998915972363, 1.2749032584832491],
            "segments.0.layers.3.keys": [7543.872992431046, -74.72018046331488],
            "segments.0.layers.3.values": [1112.340388359603, -24.430276750491554],
        },
        [[113, 172, 116, 110, 93, 157], [181, 215, 163, 215, 114, 114]],
    ),
    "gemma3_text/probe": (
        "1af0f01aee2a43459e8bab9d42367fef4f36b47b9f5ea8da8c621065322486b7",
        {
            "segments.0.layers.0.keys": [399.82701706979424, 20.335802676722977],
            "segments.0.layers.0.values": [65.25938187258726, -0.722723244910304],
            "segments.0.layers.1.keys": [7374.3057262480725, 28.16539135936482],
            "segments.0.layers.1.values": [1107.9055742405671, 17.15217462113148],
            "segments.0.layers.2.keys": [416.0617287941277, -13.874161644946291],
            "segments.0.layers.2.values": [67.91998915972363, 1.2749032584832491],
            "segments.0.layers.3.keys": [7438.995697591454, -19.97180628917079],
            "segments.0.layers.3.values": [1105.3280627006307, -32.980895737195766],
        },
        [[113, 172, 116, 110, 93, 157], [181, 215, 163, 121, 181, 215]],
    ),
    "gemma3_text/reconstruct": (
        "98911e49fa00116a5e95fccd341e7ad17ff5d8ea4d80c973bde621e82dca42dc",
        {
            "segments.0.layers.0.keys": [399.82701706979424, 20.335802676722977],
            "segments.0.layers.0.values": [65.25938187258726, -0.722723244910304],
            "segments.0.layers.1.keys": [7391.613983753021, -81.94668675190636],
            "segments.0.layers.1.values": [1136.7310443806368, 26.813542861082762],
            "segments.0.layers.2.keys": [416.0617287941277, -13.874161644946291],
            "segments.0.layers.2.values": [67.91998915972363, 1.2749032584832491],
            "segments.0.layers.3.keys": [7436.462254629005, -59.840893514531714],
            "segments.0.layers.3.values": [1099.937326640506, -33.561086451012706],
        },
        [[75, 181, 157, 163, 85, 215], [181, 215, 163, 121, 181, 215]],
    ),
    "gemma3_text/reselect": (
        "f52a0083d798c2dcf541915a2d74a504b42cb953066d6c7212849e3f9dba6cc0",
        {
            "segments.0.layers.0.keys": [399.82701706979424, 20.335802676722977],
            "segments.0.layers.0.values": [65.25938187258726, -0.722723244910304],
            "segments.0.layers.1.keys": [11350.571220508777, 3.4838235160997897],
            "segments.0.layers.1.values": [1720.2126463499126, 6.107606023810643],
            "segments.0.layers.2.keys": [416.0617287941277, -13.874161644946291],
            "segments.0.layers.2.values": [67.91998915972363, 1.2749032584832491],
            "segments.0.layers.3.keys": [11446.560980060487, -75.67944015946051],
            "segments.0.layers.3.values": [1686.0715439559212, -45.834660337889275],
        },
        [[75, 181, 157, 17, 218, 93], [181, 215, 215, 114, 181, 215]],
    ),
    "gemma3_text/sink_recent": (
        "e617d918deeb0c811035d8113251570039f60a8f40096d7a7677df1ee6b50a84",
        {
            "segments.0.layers.0.keys": [399.82701706979424, 20.335802676722977],
            "segments.0.layers.0.values": [65.25938187258726, -0.722723244910304],
            "segments.0.layers.1.keys": [7428.679952877457, -177.63111936632248],
            "segments.0.layers.1.values": [1105.6994547488903, -2.675279856850563],
            "segments.0.layers.2.keys": [416.0617287941277, -13.874161644946291],
            "segments.0.layers.2.values": [67.91998915972363, 1.2749032584832491],
            "segments.0.layers.3.keys": [7512.802876659902, 279.75525469864294],
            "segments.0.layers.3.values": [1112.938601260099, -13.094830722567929],
        },
        [[75, 181, 157, 17, 218, 17], [181, 215, 215, 114, 181, 17]],
    ),
    "gemma3_text/tail": (
        "95401ee8d9c02caab74309b92b32a73676d70eea977e647582e25c03a6e9daa4",
        {
            "segments.0.layers.0.keys": [399.82701706979424, 20.335802676722977],
            "segments.0.layers.0.values": [65.25938187258726, -0.722723244910304],
            "segments.0.layers.1.keys": [7387.4459234763635, -24.844381179719193],
            "segments.0.layers.1.values": [1119.6955015890198, 18.000139714391434],
            "segments.0.layers.2.keys": [416.0617287941277, -13.874161644946291],
            "segments.0.layers.2.values": [67.91998915972363, 1.2749032584832491],
            "segments.0.layers.3.keys": [7462.73506398988, -67.80681089663439],
            "segments.0.layers.3.values": [1101.389749606823, -24.07565728318734],
        },
        [[113, 172, 116, 110, 93, 157], [181, 215, 163, 215, 114, 114]],
    ),
    "llama/adaptive": (
        "9a759dd4b45871ee608984841e8e1931154ea2d7779db02ad7939c483fd4b6c0",
        {
            "segments.0.layers.0.keys": [1407.9218831277103, -2.935013675845465],
            "segments.0.layers.0.values": [1404.3590061629657, -21.126512213268455],
            "segments.0.layers.1.keys": [1437.1941369908163, -36.71352052697053],
            "segments.0.layers.1.values": [1380.5096985558994, 43.377609467294185],
        },
        [[206, 206, 206, 206, 206, 206], [206, 206, 206, 206, 206, 206]],
    ),
    "llama/probe": (
        "72bf2170676fbd35a5cdfdd7742870d258a6d88d9af0998d0f1075fbbbf25b89",
        {
            "segments.0.layers.0.keys": [1422.458737050416, 16.047525471483027],
            "segments.0.layers.0.values": [1423.1466571751516, -0.3141398436330327],
            "segments.0.layers.1.keys": [1433.0290538001573, -74.56712795794036],
            "segments.0.layers.1.values": [1355.349305333366, 50.89193195867438],
        },
        [[206, 206, 206, 206, 206, 206], [206, 206, 206, 206, 206, 206]],
    ),
    "llama/reconstruct": (
        "20e993ca7af5aa8be435339febf45eecaf6c9213650750b3a0502d63ac90f500",
        {
            "segments.0.layers.0.keys": [1459.1934052928118, 31.617250711715556],
            "segments.0.layers.0.values": [1457.2883686847053, -18.191207781525463],
            "segments.0.layers.1.keys": [1486.9063286740566, -28.460446867668054],
            "segments.0.layers.1.values": [1374.3867541942163, 44.857186087376505],
        },
        [[206, 206, 206, 206, 206, 206], [206, 206, 206, 206, 206, 206]],
    ),
    "llama/reselect": (
        "858da6a2f7e2230e2ea60facf3a66daa3a80c2f72547a89494d2027245308553",
        {
            "segments.0.layers.0.keys": [2177.771974214178, -5.123422253280038],
            "segments.0.layers.0.values": [2190.574168035353, -26.60067148958825],
            "segments.0.layers.1.keys": [2169.122898657224, -73.41597409575559],
            "segments.0.layers.1.values": [2101.073279856908, 56.33851458620143],
        },
        [[206, 206, 206, 206, 206, 206], [206, 206, 206, 206, 206, 206]],
    ),
    "llama/sink_recent": (
        "36df659ddb2ffa5083d7d349f29658ab121ad2ba1006d2f4ee7baac5c3f735a3",
        {
            "segments.0.layers.0.keys": [1407.453894589882, 0.3959415670504778],
            "segments.0.layers.0.values": [1434.2257353060995, -0.3427668598958391],
            "segments.0.layers.1.keys": [1438.0795308339875, -116.5418349880136],
            "segments.0.layers.1.values": [1394.2844350715823, 48.534893252154625],
        },
        [[206, 206, 206, 206, 206, 206], [206, 206, 206, 206, 206, 206]],
    ),
    "llama/tail": (
        "d38d259f33759816fb7df117b1e7b1213b9bdc471e74dc5bc25183f7dfb97708",
        {
            "segments.0.layers.0.keys": [1429.9476168938563, -3.423282954206914],
            "segments.0.layers.0.values": [1425.803344775457, -20.430053467987346],
            "segments.0.layers.1.keys": [1417.2554070776096, -38.39875890083195],
            "segments.0.layers.1.values": [1359.7193734695102, 44.68029268322033],
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
    far = {
        k: (sums[k], v)
        for k, v in expected_sums.items()
        if max(abs(a - b) for a, b in zip(sums[k], v)) > REL_TOL * max(v[0], 1e-12)
    }  # relative to Σ|x|
    assert not far, f"float tensors off by more than {REL_TOL:g} relative (got, recorded): {far}"
