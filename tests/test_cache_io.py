"""The .kv file: round trip, atomic writes, and refusal of damaged or foreign files (docs/file-format.md)."""

import dataclasses
import json
import os
import struct

import pytest
import torch
from conftest import make_engine, text_of_bytes
from safetensors.torch import save_file

from rocketkv_cli.core.config import PrefillConfig
from rocketkv_cli.engine.inputs import Document
from rocketkv_cli.errors import CacheFormatError, OutputError
from rocketkv_cli.store.format import FORMAT_VERSION, load_cache, metadata_digest, payload_digest, save_cache


@pytest.fixture(scope="module")
def stored():
    engine = make_engine("llama", torch.float32)
    document = Document(text=text_of_bytes(300), sha256="0" * 64, source="doc.txt")
    return engine.ingest(document, PrefillConfig(token_budget=32, max_new_tokens=8, window_size=8))


@pytest.fixture()
def kv_file(stored, tmp_path):
    return save_cache(stored, tmp_path / "doc.kv")


def test__round_trip__bit_exact_and_metadata_kept(stored, kv_file):
    loaded = load_cache(kv_file)
    for a, b in zip(stored.layers, loaded.layers):
        for kind in ("keys", "values", "positions"):
            x, y = getattr(a, kind), getattr(b, kind)
            assert torch.equal(x, y) and x.dtype == y.dtype, kind
    assert loaded.info.format_version == 4 and loaded.info.created_at  # the oldest version holding it (v5: alloc)
    kept = ("identity", "dtype", "n_context_tokens", "document_sha256", "document_source", "config", "budgets",
            "pool_kernel_size", "segment", "storage")  # fmt: skip
    for field in kept:
        assert getattr(loaded.info, field) == getattr(stored.info, field), field


def test__save__refuses_existing_without_force_and_replaces_with_force(stored, kv_file):
    before = kv_file.read_bytes()
    with pytest.raises(OutputError, match="--force"):
        save_cache(stored, kv_file)
    assert kv_file.read_bytes() == before
    save_cache(stored, kv_file, force=True)
    assert load_cache(kv_file).n_context_tokens == stored.n_context_tokens


def test__save__never_writes_through_a_symlink(stored, tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    link = tmp_path / "out.kv"
    link.symlink_to(victim)
    with pytest.raises(OutputError):
        save_cache(stored, link)
    save_cache(stored, link, force=True)
    assert victim.read_text() == "precious" and not link.is_symlink()


def test__save__missing_directory_is_an_output_error(stored, tmp_path):
    with pytest.raises(OutputError, match="does not exist"):
        save_cache(stored, tmp_path / "nope" / "doc.kv")


def test__save__failure_halfway_leaves_old_file_and_no_temp(stored, kv_file, monkeypatch):
    before = kv_file.read_bytes()

    def boom(*a, **k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", boom)  # fails after the bytes were written to the temp file
    with pytest.raises(OutputError, match="No space"):
        save_cache(stored, kv_file, force=True)
    assert kv_file.read_bytes() == before
    assert [p.name for p in kv_file.parent.iterdir()] == [kv_file.name]


@pytest.mark.parametrize("cut", [0, 7, 100, -1000, -1])
def test__load__truncated_file_refused(kv_file, cut):
    data = kv_file.read_bytes()
    kv_file.write_bytes(data[: cut if cut >= 0 else len(data) + cut])
    with pytest.raises(CacheFormatError):
        load_cache(kv_file)


def test__load__cut_in_its_tensors__names_the_size_it_has_and_the_size_its_header_describes(kv_file):
    data = kv_file.read_bytes()
    kv_file.write_bytes(data[: len(data) // 2])
    want = f"is truncated or damaged: {len(data) // 2:,} bytes, its header describes {len(data):,}"
    with pytest.raises(CacheFormatError, match=want):
        load_cache(kv_file)


def test__load__cut_inside_its_header__named_truncated_not_another_format(kv_file):
    """A cache cut inside its header (an interrupted copy) was "not a rocketkv cache (bad header
    length)"; it is a truncated cache, with the size it has and the size its header needs."""
    (n,) = struct.unpack("<Q", kv_file.read_bytes()[:8])
    kv_file.write_bytes(kv_file.read_bytes()[:100])
    with pytest.raises(
        CacheFormatError, match=f"is truncated: 100 bytes, shorter than its own header \\({n + 8:,} bytes\\)"
    ):
        load_cache(kv_file)


def test__load__flipped_payload_byte_detected(kv_file):
    data = bytearray(kv_file.read_bytes())
    data[-5] ^= 0x40
    kv_file.write_bytes(bytes(data))
    with pytest.raises(CacheFormatError, match="digest"):
        load_cache(kv_file)


def _rewrite_metadata(path, redigest=True, **changes):
    """Edit metadata; with `redigest` also recompute its digest (a deliberate, consistent edit)."""
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    header["__metadata__"].update(changes)
    if redigest:
        header["__metadata__"]["metadata_sha256"] = metadata_digest(header["__metadata__"])
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data[8 + n :])


def test__load__edited_metadata_detected_by_its_digest(kv_file):
    _rewrite_metadata(kv_file, redigest=False, n_context_tokens="99999")
    with pytest.raises(CacheFormatError, match="metadata digest"):
        load_cache(kv_file)


def test__load__newer_format_version_refused(kv_file):
    _rewrite_metadata(kv_file, format_version=str(FORMAT_VERSION + 1))
    with pytest.raises(CacheFormatError, match="newer"):
        load_cache(kv_file)


def test__load__metadata_claiming_other_shapes_refused(kv_file):
    _rewrite_metadata(kv_file, head_dim="8")
    with pytest.raises(CacheFormatError, match="disagree"):
        load_cache(kv_file)


def test__load__header_claiming_enormous_tensor_refused_before_allocation(kv_file):
    data = kv_file.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    header["segments.0.layers.0.keys"]["shape"] = [1 << 20, 1 << 20, 1 << 10]
    raw = json.dumps(header).encode()
    kv_file.write_bytes(struct.pack("<Q", len(raw)) + raw + data[8 + n :])
    with pytest.raises(CacheFormatError):
        load_cache(kv_file)


def test__load__header_with_an_integer_json_cannot_read__refused_as_unreadable(kv_file):
    """A shape of 5,000 digits is JSON, but past Python's limit for reading an integer: a
    ValueError (not a JSONDecodeError) that escaped as "unexpected ValueError"."""
    data = kv_file.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    raw = data[8 : 8 + n].replace(b'"shape":[', b'"shape":[' + b"9" * 5000 + b",", 1)
    kv_file.write_bytes(struct.pack("<Q", len(raw)) + raw + data[8 + n :])
    with pytest.raises(CacheFormatError, match="unreadable header"):
        load_cache(kv_file)


def test__load__random_bytes_and_foreign_safetensors_refused(tmp_path):
    junk = tmp_path / "junk.kv"
    junk.write_bytes(os.urandom(4096))
    with pytest.raises(CacheFormatError):
        load_cache(junk)
    weights = tmp_path / "model.safetensors"
    save_file({"w": torch.zeros(3)}, str(weights))
    with pytest.raises(CacheFormatError, match="not a rocketkv cache"):
        load_cache(weights)


def test__open_cache__other_model_or_tokenizer_refused_with_rebuild_command(stored, kv_file):
    other = make_engine("llama", torch.float32, seed=1)  # same architecture, other weights
    with pytest.raises(CacheFormatError, match="another model") as info:
        other.check(load_cache(kv_file), str(kv_file))
    assert "rocketkv ingest" in str(info.value)
    same = make_engine("llama", torch.float32)
    same.identity = dataclasses.replace(same.identity, tokenizer_digest="0" * 64)
    with pytest.raises(CacheFormatError, match="another tokenizer"):
        same.check(load_cache(kv_file), str(kv_file))


def test__payload_digest__covers_every_tensor(stored):
    tensors = {"a": torch.zeros(4), "b": torch.ones(2)}
    d1 = payload_digest(tensors)
    tensors["b"] = torch.tensor([1.0, 1.0000001])
    assert payload_digest(tensors) != d1


def test__resident_bytes__counts_decoded_layers_and_each_buffer_once(kv_file):
    """What a server budgets a cache by once it is answered from: its float keys and values
    (int codes decode to 4-byte floats) and positions, plus at most the file's bytes again (the
    codes they came from, the token arrays)."""
    from rocketkv_cli.core.cache import tensor_bytes

    loaded = load_cache(kv_file)
    layers = loaded.layers
    floats = sum(t.numel() * t.element_size() for layer in layers for t in (layer.keys, layer.values))
    positions = sum(layer.positions.numel() * layer.positions.element_size() for layer in layers)
    assert floats > 0
    assert floats + positions <= loaded.resident_bytes <= floats + positions + 2 * kv_file.stat().st_size
    buffer = torch.zeros(10, 4)
    assert tensor_bytes([buffer, buffer[:3], buffer[5:].view(-1)]) == 160  # views of one buffer: once
    assert tensor_bytes([buffer, torch.zeros(2), None]) == 168
