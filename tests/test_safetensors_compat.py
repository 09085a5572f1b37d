"""Every `.kv` file rocketkv writes is a plain safetensors file: the `safetensors` library opens it
(`safe_open`) and gives, name by name, exactly the tensors rocketkv's own loader reads from it
(docs/file-format.md: rocketkv reads its bytes itself, for the reasons given there, and this test
holds the two readers to one another). Also the files of older versions kept in tests/data/.
"""

from pathlib import Path

import pytest
import torch
from conftest import make_engine, text_of_bytes
from safetensors import safe_open

from rocketkv_cli.api.documents import TextPieces
from rocketkv_cli.api.segments import ingest_stream
from rocketkv_cli.core.cache import CompressedKVCache
from rocketkv_cli.core.config import PrefillConfig
from rocketkv_cli.core.quant import KVStorage
from rocketkv_cli.engine.inputs import Document
from rocketkv_cli.store.format import all_segments, load_cache, read_metadata, save_cache
from rocketkv_cli.store.v3 import line_runs, lines_from_runs

CFG = PrefillConfig(token_budget=64, max_new_tokens=8, window_size=8, pool_kernel_size=7)
DATA = Path(__file__).resolve().parent / "data"
TEXT = "".join(f"line {i} holds the river stone {text_of_bytes(12, i)}\n" for i in range(30))


def library_tensors(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Every tensor of the file by name, and its metadata, as the safetensors library reads them."""
    with safe_open(str(path), framework="pt") as f:
        return {name: f.get_tensor(name) for name in f.keys()}, f.metadata()  # noqa: SIM118  (not a dict)


def same(a: torch.Tensor, b: torch.Tensor | None) -> bool:
    return b is not None and a.dtype == b.dtype and torch.equal(a, b)


def assert_same_as_the_loader(path: Path) -> None:
    """safe_open's tensors equal rocketkv's: the stored KV tensors (`stored_loader`, before
    dequantization) and the token tensors of each segment (v3+), or each layer's keys, values and
    positions and the token ids (v1/v2); the pads are zeros; the metadata is `read_metadata`'s."""
    tensors, meta = library_tensors(path)
    assert meta == read_metadata(path)
    cache = load_cache(path, lazy=True)
    segments = all_segments(cache)
    version = int(meta["format_version"])
    seen = set()
    for j, seg in enumerate(segments):
        prefix = "" if version == 1 else f"segments.{j}."
        if version <= 2:
            for i, layer in enumerate(seg.layers):
                for kind in ("keys", "values", "positions"):
                    name = f"{prefix}layers.{i}.{kind}"
                    assert same(tensors[name], getattr(layer, kind)[0]), name
                    seen.add(name)
        else:
            for name, stored in seg.stored_loader().items():  # the raw stored tensors, by name
                assert same(tensors[prefix + name], stored), prefix + name
                seen.add(prefix + name)
            for pad in ("kv_pad", "tokens_pad"):
                assert tensors[prefix + pad].dtype == torch.uint8 and not tensors[prefix + pad].any()
                seen.add(prefix + pad)
            if f"{prefix}token_line_runs" in tensors:  # v4+: lines as runs, read back per token
                runs = tensors[f"{prefix}token_line_runs"]
                assert same(lines_from_runs(runs, seg.n_context_tokens), seg.token_lines)
                assert same(runs, line_runs(seg.token_lines))
                seen.add(f"{prefix}token_line_runs")
            if f"{prefix}token_lines" in tensors:  # v3: per token
                assert same(tensors[f"{prefix}token_lines"], seg.token_lines)
                seen.add(f"{prefix}token_lines")
            if f"{prefix}token_offsets" in tensors:  # int32 on file, int64 in memory
                offsets = tensors[f"{prefix}token_offsets"]
                assert offsets.dtype in (torch.int32, torch.int64) and same(offsets.long(), seg.token_offsets)
                seen.add(f"{prefix}token_offsets")
        if f"{prefix}token_ids" in tensors:
            assert same(tensors[f"{prefix}token_ids"], seg.token_ids)
            seen.add(f"{prefix}token_ids")
        seg.release()
    assert seen == set(tensors), set(tensors) ^ seen


@pytest.fixture(scope="module")
def llama():
    return make_engine("llama", torch.float32)


@pytest.mark.parametrize("storage", ["float32", "bfloat16", "int8", "int4", "int4+rope", "int4+hadamard",
                                     "int4+sinks0", "int4+alloc"])  # fmt: skip
def test__safe_open__reads_every_storage_as_rocketkv_does(llama, storage, tmp_path):
    stored = llama.ingest(Document(TEXT, "0" * 64, "d.txt"), CFG, storage=KVStorage.parse(storage))
    path = save_cache(stored, tmp_path / "doc.kv")
    assert stored.token_ids is not None and stored.token_lines is not None  # the token tensors are written
    assert_same_as_the_loader(path)


def test__safe_open__reads_a_segmented_file_as_rocketkv_does(llama, tmp_path):
    text = "".join(text_of_bytes(40 + i, i) + "\n" for i in range(30))
    stored = ingest_stream(llama, TextPieces(text, "book.txt"), CFG, segment_tokens=300, storage=KVStorage("int4"))
    path = save_cache(stored, tmp_path / "book.kv")
    assert len(all_segments(load_cache(path, lazy=True))) >= 3
    assert_same_as_the_loader(path)


def test__safe_open__reads_a_sliding_window_model_file_as_rocketkv_does(tmp_path):
    engine = make_engine("gemma3_text", torch.float32)
    stored = engine.ingest(Document(TEXT, "0" * 64, "d.txt"), CFG, storage=KVStorage("int8"))
    assert isinstance(stored, CompressedKVCache)
    assert_same_as_the_loader(save_cache(stored, tmp_path / "g.kv"))


@pytest.mark.parametrize("name", sorted(p.name for p in DATA.glob("*.kv")))
def test__safe_open__reads_the_files_of_every_older_version_as_rocketkv_does(name):
    assert_same_as_the_loader(DATA / name)


def test__library_writer__lays_the_same_tensors_out_otherwise(llama, tmp_path):
    """Why rocketkv writes the bytes itself (docs/file-format.md): `safetensors.torch.save` of the
    very tensors and metadata of a file orders them by dtype over the whole file, so a segment's
    KV is no longer one contiguous range and the bytes differ. Should a safetensors version keep
    rocketkv's order, this fails, and the writer may go through the library."""
    from safetensors.torch import save

    text = "".join(text_of_bytes(40 + i, i) + "\n" for i in range(20))
    stored = ingest_stream(llama, TextPieces(text, "book.txt"), CFG, segment_tokens=300, storage=KVStorage("int4"))
    path = save_cache(stored, tmp_path / "book.kv")
    tensors, meta = library_tensors(path)
    assert save(tensors, meta) != path.read_bytes()
