"""Documents longer than the context: streaming, segmenting, the v2 file, resume, routing.

A tiny random Llama with the byte tokenizer (1 token per byte) and segments of a few hundred
tokens, so that a few-thousand-byte document already needs many segments.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import signal
import subprocess
import time

import pytest
import torch
from conftest import byte_tokenizer, make_engine, same_layer, text_of_bytes
from hypothesis import given, settings
from hypothesis import strategies as st

from rocketkv_cli.api.documents import TextPieces, TextStream, segment_texts, token_counts
from rocketkv_cli.api.segments import (
    answer_segmented,
    frame_tokens,
    ingest_stream,
    lexical_scores,
    merge_segments,
    question_queries,
    route,
    segment_scores,
)
from rocketkv_cli.core.cache import CompressedKVCache, LayerKV, SegmentedKVCache
from rocketkv_cli.core.config import PrefillConfig
from rocketkv_cli.engine.answer import answer, decode_config_for
from rocketkv_cli.engine.inputs import Document
from rocketkv_cli.errors import CacheFormatError
from rocketkv_cli.store.checkpoints import Checkpoints
from rocketkv_cli.store.format import load_cache, read_metadata
from rocketkv_cli.store.format import save_cache as save_segmented

CFG = PrefillConfig(token_budget=64, max_new_tokens=8, window_size=8, pool_kernel_size=7, chunk_tokens=64)


def lines_text(n_lines: int, seed: int = 0) -> str:
    return "".join(text_of_bytes(30 + (i * 7) % 50, seed + i) + "\n" for i in range(n_lines))


@pytest.fixture(scope="module")
def engine():
    return make_engine("llama", torch.float32)


# --- streaming and segmenting ------------------------------------------------------------------


def test__text_stream_pieces_join_to_the_file_and_digest_its_bytes(tmp_path):
    data = ("ünïcode line\n" * 200_000).encode() + b"last line without newline"
    path = tmp_path / "doc.txt"
    path.write_bytes(b"\xef\xbb\xbf" + data)  # with a BOM
    stream = TextStream(str(path))
    pieces = list(stream)
    assert len(pieces) > 2, "a 2.6 MB file must come in several pieces"
    assert all(p.endswith("\n") for p in pieces[:-1])
    assert "".join(pieces) == data.decode()
    assert stream.sha256 == hashlib.sha256(b"\xef\xbb\xbf" + data).hexdigest()
    assert stream.bytes_read == stream.total_bytes == len(data) + 3


def test__text_stream_validate_names_the_byte_offset_before_any_work(tmp_path):
    from rocketkv_cli.errors import InputError

    path = tmp_path / "bad.txt"
    path.write_bytes(b"a" * 3_000_000 + b"\xff" + b"b" * 10)
    with pytest.raises(InputError, match="byte offset 3000000"):
        TextStream(str(path)).validate()


@settings(max_examples=40, deadline=None)
@given(
    text=st.text(alphabet=st.sampled_from(list("ab \n\té")), min_size=0, max_size=600),
    max_tokens=st.integers(min_value=4, max_value=50),  # a character can be 4 byte tokens
)
def test__segment_texts_partition_the_text_within_the_budget(text, max_tokens):
    tok = byte_tokenizer()
    segments = list(segment_texts(tok, [text[: len(text) // 2], text[len(text) // 2 :]], max_tokens))
    assert "".join(segments) == text
    counts = token_counts(tok, segments)
    assert all(c <= max_tokens for c in counts), (counts, max_tokens)
    assert all(segments), "no empty segment"


def test__segments_end_at_line_ends_when_lines_fit():
    tok = byte_tokenizer()
    text = lines_text(40)
    segments = list(segment_texts(tok, [text], 200))
    assert len(segments) > 5
    assert all(s.endswith("\n") for s in segments)


# --- segmented ingest ---------------------------------------------------------------------------


def test__short_document_is_one_segment_exactly_as_before(engine):
    text = lines_text(5)
    stored = ingest_stream(engine, TextPieces(text, "doc.txt"), CFG, segment_tokens=400)
    direct = engine.ingest(Document(text, TextPieces(text, "doc.txt").sha256, "doc.txt"), CFG)
    assert isinstance(stored, CompressedKVCache)
    assert all(same_layer(a, b) for a, b in zip(stored.layers, direct.layers))


def test__each_segment_is_prefilled_on_its_own(engine):
    text = lines_text(40)
    stored = ingest_stream(engine, TextPieces(text, "doc.txt"), CFG, segment_tokens=300)
    assert isinstance(stored, SegmentedKVCache) and len(stored.segments) >= 5
    frame = frame_tokens(engine)
    pieces = list(segment_texts(engine.tokenizer, [text], 300 - frame - 16))
    assert len(pieces) == len(stored.segments)
    start = 0
    for j, (part, piece) in enumerate(zip(stored.segments, pieces)):
        alone = engine.ingest(Document(piece, "", ""), CFG)
        assert part.n_context_tokens == alone.n_context_tokens <= 300
        assert part.info.segment.start_token == start and part.info.segment.index == j, j
        start += alone.n_context_tokens - frame
        assert all(same_layer(a, b) for a, b in zip(part.layers, alone.layers)), f"segment {j} differs from its own"
    assert stored.n_context_tokens == sum(p.n_context_tokens for p in stored.segments)


def test__segmented_file_round_trips_and_is_plain_safetensors(engine, tmp_path):
    from safetensors import safe_open

    stored = ingest_stream(engine, TextPieces(lines_text(30), "doc.txt"), CFG, segment_tokens=300)
    path = save_segmented(stored, tmp_path / "book.kv")
    loaded = load_cache(path)
    assert isinstance(loaded, SegmentedKVCache) and len(loaded.segments) == len(stored.segments)
    assert loaded.info.format_version == 4
    for a, b in zip(stored.segments, loaded.segments):
        assert a.n_context_tokens == b.n_context_tokens
        assert a.info.segment == b.info.segment
        assert a.info.budgets == b.info.budgets and a.info.pool_kernel_size == b.info.pool_kernel_size
        assert all(same_layer(la, lb) for la, lb in zip(a.layers, b.layers))
    with safe_open(str(path), framework="pt") as f:  # the reference reader accepts the layout
        assert torch.equal(f.get_tensor("segments.1.layers.0.keys"), stored.segments[1].layers[0].keys[0])
    raw = bytearray(path.read_bytes())
    raw[-5] ^= 0xFF
    (tmp_path / "bad.kv").write_bytes(bytes(raw))
    with pytest.raises(CacheFormatError, match="digest mismatch"):
        load_cache(tmp_path / "bad.kv")


def test__measuring_a_file_read_lazily_holds_one_segment_at_a_time(engine, tmp_path):
    # `ingest` prints "keeping up to N per KV head": on the whole KJV (37 segments, a 2.1 GB file)
    # measuring that kept every segment's dequantized KV in memory (peak RSS 13.1 GB)
    stored = ingest_stream(engine, TextPieces(lines_text(30), "doc.txt"), CFG, segment_tokens=300)
    loaded = load_cache(save_segmented(stored, tmp_path / "book.kv"), lazy=True)
    assert len(loaded.segments) > 2
    by_hand = max(layer.keys.shape[2] for seg in stored.segments for layer in seg.layers)
    assert loaded.max_kept_tokens == by_hand
    assert loaded.kv_bytes == sum(layer.nbytes for seg in stored.segments for layer in seg.layers)
    held = [j for j, seg in enumerate(loaded.segments) if seg._layers is not None]
    assert not held, f"segments {held} stay in memory after being measured"
    first = loaded.segments[0]
    first.layers  # noqa: B018  (read on purpose: a segment in use stays read)
    assert loaded.max_kept_tokens == by_hand and first._layers is not None


def test__answering_from_a_file_read_lazily_keeps_no_segment_decoded(engine, tmp_path):
    """A server answering a book question after question, each routed to another segment, held
    every segment it had answered from, decoded to float32 (10.5 GB for the KJV's 2.1 GB file):
    now a segment's decoded layers leave memory once the decoder has its copy (its verified
    int8 codes stay), and routing by keys and merging segments release what they read. The
    answers are those of the in-memory cache."""
    from rocketkv_cli.core.quant import KVStorage
    from rocketkv_cli.engine.answer import KeptAnswerer

    stored = ingest_stream(engine, TextPieces(lines_text(30), "doc.txt"), CFG, segment_tokens=300,
                           storage=KVStorage("int8"))  # fmt: skip
    loaded = load_cache(save_segmented(stored, tmp_path / "book.kv"), lazy=True)
    assert isinstance(loaded, SegmentedKVCache) and len(loaded.segments) > 2

    def held() -> list[int]:
        return [j for j, seg in enumerate(loaded.segments) if seg._layers is not None]

    kept = KeptAnswerer()
    for j in range(len(loaded.segments)):
        got = next(answer_segmented(engine, loaded, ["which word?"], 4, True, {}, segment=j, kept=kept))
        want = next(answer_segmented(engine, stored, ["which word?"], 4, True, {}, segment=j))
        assert got.token_ids == want.token_ids, j
        assert not held(), f"segments {held()} stay decoded after answering from segment {j}"
        assert (
            0
            < loaded.segments[j].resident_bytes
            < sum(  # the int8 codes, not the float32 layers
                t.numel() * 4 for layer in stored.segments[j].layers for t in (layer.keys, layer.values)
            )
        )
        assert kept.held_bytes() > 0  # the decoder's own copy
    segment_scores(engine, loaded, "zzz qqq?")
    assert not held(), f"segments {held()} stay in memory after routing by keys"
    merged = merge_segments(loaded, [0, 2])
    assert not held(), f"segments {held()} stay in memory after merging"
    assert merged.resident_bytes > 0


def test__interrupted_ingest_resumes_from_the_checkpoints(engine, tmp_path):
    text = lines_text(40)
    target = tmp_path / "book.kv"
    checkpoints = Checkpoints(target)
    seen = []

    def stop_after_three(event):
        seen.append(event)
        if len(seen) == 3:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        ingest_stream(engine, TextPieces(text, "doc.txt"), CFG, 300, checkpoints, stop_after_three)
    assert checkpoints.count() == 3 and not target.exists()
    events = []
    resumed = ingest_stream(engine, TextPieces(text, "doc.txt"), CFG, 300, checkpoints, events.append)
    assert [e.resumed for e in events[:3]] == [True] * 3 and not any(e.resumed for e in events[3:])
    fresh = ingest_stream(engine, TextPieces(text, "doc.txt"), CFG, 300)
    for a, b in zip(resumed.segments, fresh.segments):
        assert all(same_layer(la, lb) for la, lb in zip(a.layers, b.layers))
    changed = ingest_stream(engine, TextPieces("changed\n" + text, "doc.txt"), CFG, 300, checkpoints, events.append)
    assert not any(e.resumed for e in events[len(resumed.segments) :]), "a changed document reused checkpoints"
    assert len(changed.segments) >= len(resumed.segments)


def test__checkpoints_of_another_dtype_are_not_reused(tmp_path):
    text = lines_text(40)
    checkpoints = Checkpoints(tmp_path / "book.kv")
    stop = []

    def stop_after_two(event):
        stop.append(event)
        if len(stop) == 2:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        ingest_stream(make_engine("llama", torch.float32), TextPieces(text, "d"), CFG, 300, checkpoints, stop_after_two)
    events = []
    stored = ingest_stream(
        make_engine("llama", torch.float64), TextPieces(text, "d"), CFG, 300, checkpoints, events.append
    )
    assert not any(e.resumed for e in events), "float32 checkpoints reused in a float64 ingest"
    assert {p.layers[0].keys.dtype for p in stored.segments} == {torch.float64}
    save_segmented(stored, tmp_path / "book.kv")
    assert isinstance(load_cache(tmp_path / "book.kv"), SegmentedKVCache)


def test__whitespace_only_stream_longer_than_a_segment_is_refused(engine):
    from rocketkv_cli.errors import InputError

    with pytest.raises(InputError, match="whitespace only"):
        ingest_stream(engine, TextPieces("  \n" * 2000, "-"), CFG, segment_tokens=300)


def test__an_in_memory_text_with_a_nul_is_refused_as_a_file_with_one_is(engine):
    """`text=` and a batch row's "text" are refused where a document file with the same bytes is
    (a NUL: binary), naming the byte offset, before any prefill."""
    from rocketkv_cli.errors import InputError

    with pytest.raises(InputError, match=r"looks binary \(NUL character at byte offset 6\)"):
        ingest_stream(engine, TextPieces("héllo\x00world", "<text>"), CFG, segment_tokens=300)


# --- routing and answering -----------------------------------------------------------------------


def _plant(engine, stored, question: str, target: int) -> SegmentedKVCache:
    """A copy of `stored` where segment `target` holds, per KV head, one key along its group's mean
    query of `question` (so that the question's queries score that segment highest)."""
    position = max(p.n_context_tokens for p in stored.segments)
    queries = question_queries(engine, question, position)
    group = engine.shape.n_heads // engine.shape.n_kv_heads
    parts = list(stored.segments)
    layers = list(parts[target].layers)
    for i, q in queries.items():
        keys = layers[i].keys
        planted = q[0].view(keys.shape[1], group, q.shape[2], -1).mean(dim=(1, 2)) * 50.0  # [Hkv, D]
        keys = keys.clone()
        keys[0, :, -2] = planted.to(keys.dtype)
        layers[i] = LayerKV(keys, layers[i].values, layers[i].positions)
    parts[target] = CompressedKVCache(info=parts[target].info, layers=tuple(layers), token_ids=parts[target].token_ids)
    return SegmentedKVCache(info=stored.info, segments=tuple(parts))


def test__keys_score_picks_the_segment_holding_a_key_aligned_with_the_question(engine):
    stored = ingest_stream(engine, TextPieces(lines_text(30), "doc.txt"), CFG, segment_tokens=300)
    question, target = "where is the stone?", 2
    planted = _plant(engine, stored, question, target)
    scores = segment_scores(engine, planted, question)
    assert int(scores.argmax()) == target, scores
    parts = planted.segments
    order = [3, 0, 2, 1] + list(range(4, len(parts)))  # scores follow the segments, not their order
    permuted = SegmentedKVCache(info=stored.info, segments=tuple(parts[j] for j in order))
    assert torch.allclose(segment_scores(engine, permuted, question), scores[order], atol=1e-5)


def test__route_falls_back_to_the_keys_when_no_word_of_the_question_occurs(engine):
    stored = ingest_stream(engine, TextPieces(lines_text(30), "doc.txt"), CFG, segment_tokens=300)
    no_terms, target = "zzz qqq?", 3  # no letter of it occurs in the document: BM25 is 0 everywhere
    planted = _plant(engine, stored, no_terms, target)
    assert float(lexical_scores(engine, planted, no_terms).max()) == 0.0
    assert route(engine, planted, no_terms, 1) == [target]


def test__route_by_terms_finds_the_segment_with_the_rare_word(engine):
    lines = lines_text(30).splitlines(keepends=True)
    lines.insert(22, "the zebra bazaar\n")  # 'z' and 'b' occur nowhere else (byte tokens are the terms)
    stored = ingest_stream(engine, TextPieces("".join(lines), "doc.txt"), CFG, segment_tokens=300)
    texts = [engine.tokenizer.decode(p.token_ids.tolist()) for p in stored.segments]
    own = next(j for j, t in enumerate(texts) if "zebra" in t)
    assert own > 0
    assert route(engine, stored, "where is the zebra?", 1) == [own]
    assert own in route(engine, stored, "where is the zebra?", 3) and len(route(engine, stored, "zebra", 3)) == 3


def test__bm25_matches_the_formula_by_hand(engine):
    import math
    import re

    lines = lines_text(30).splitlines(keepends=True)
    lines[5:5] = ["marble marble, Marble\n"]
    lines[25:25] = ["marble\n"]
    stored = ingest_stream(engine, TextPieces("".join(lines), "doc.txt"), CFG, segment_tokens=300)
    texts = [engine.tokenizer.decode(p.token_ids.tolist(), skip_special_tokens=True) for p in stored.segments]
    seg_words = [re.findall(r"[a-z0-9]+", t.lower()) for t in texts]
    counts = [w.count("marble") for w in seg_words]
    lengths = [len(w) for w in seg_words]
    n, df, avg = len(counts), sum(c > 0 for c in counts), sum(lengths) / len(lengths)
    assert 0 < df < n, "the word must be in some segments only"
    idf = math.log(1 + (n - df + 0.5) / (df + 0.5))
    expected = [idf * c * 2.2 / (c + 1.2 * (0.25 + 0.75 * length / avg)) for c, length in zip(counts, lengths)]
    got = lexical_scores(engine, stored, "Marble?").tolist()
    assert got == pytest.approx(expected, rel=1e-5), (got, expected)


def test__a_rare_word_counts_as_one_term_however_it_is_tokenized(engine):
    lines = lines_text(30).splitlines(keepends=True)
    lines.insert(22, "the word quixotic is here\n")
    stored = ingest_stream(engine, TextPieces("".join(lines), "doc.txt"), CFG, segment_tokens=300)
    scores = lexical_scores(engine, stored, "where is quixotic")  # 8 byte tokens, all common letters but q, x
    assert int((scores > 0).sum()) >= 1 and scores.argmax() == route(engine, stored, "where is quixotic", 1)[0]


def test__one_routed_segment_answers_as_that_segment_alone(engine):
    stored = ingest_stream(engine, TextPieces(lines_text(30), "doc.txt"), CFG, segment_tokens=300)
    part = merge_segments(stored, [1])
    assert part is stored.segments[1]
    merged = merge_segments(stored, [0, 2])
    assert merged.n_context_tokens == max(stored.segments[0].n_context_tokens, stored.segments[2].n_context_tokens)
    a = next(answer(engine, merged, ["which word?"], 4, decode_config_for(merged)))
    assert a.n_answer_tokens >= 1


# --- the CLI --------------------------------------------------------------------------------------


def test__cli_ingest_segments_resumes_after_sigint_and_answers(rocketkv_bin, tiny_model_dir, tmp_path):
    doc = tmp_path / "book.txt"
    doc.write_text(lines_text(200))  # ~11K tokens, 1 byte each: many 512-token segments
    out = tmp_path / "book.kv"
    cmd = [rocketkv_bin, "ingest", str(doc), "-o", str(out), "--model", str(tiny_model_dir), "--segment-tokens",
           "512", "--budget", "128", "--max-new-tokens", "8"]  # fmt: skip
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    proc = subprocess.Popen(
        cmd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )  # even as a background job
    ckpt = tmp_path / ".book.kv.segments"
    deadline = time.time() + 120
    while time.time() < deadline and (not ckpt.is_dir() or len(list(ckpt.glob("*.kv"))) < 2):
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 130, stderr
    assert "checkpointed in" in stderr and "rerun the same command to resume" in stderr, stderr
    assert not out.exists() and len(list(ckpt.glob("*.kv"))) >= 2
    r = subprocess.run(cmd + ["--json"], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "resuming" in r.stderr and "found checkpointed" in r.stderr
    reused = re.search(
        r"prefilled [\d,]+ tokens in \d+ segments \(([\d,]+) tokens of (\d+) segments? read back", r.stderr
    )
    assert reused and int(reused[2]) >= 2, r.stderr  # the summary line tells read-back work from this run's
    row = json.loads(r.stdout)
    assert row["n_segments"] >= 15 and not ckpt.exists()
    fresh = tmp_path / "fresh.kv"
    r2 = subprocess.run(cmd[:4] + [str(fresh)] + cmd[5:] + ["-q"], env=env, capture_output=True, text=True, timeout=300)
    assert r2.returncode == 0, r2.stderr
    assert read_metadata(out)["payload_sha256"] == read_metadata(fresh)["payload_sha256"]
    stale = tmp_path / ".short.kv.segments"  # left by an interrupted segmented ingest into short.kv
    stale.mkdir()
    (stale / "000000.kv").write_bytes(b"left from another run")
    (tmp_path / "short.txt").write_text(lines_text(3))
    r3 = subprocess.run([rocketkv_bin, "ingest", str(tmp_path / "short.txt"), "-o", str(tmp_path / "short.kv"),
                         *cmd[5:], "-q"], env=env, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert r3.returncode == 0, r3.stderr
    assert isinstance(load_cache(tmp_path / "short.kv"), CompressedKVCache)
    assert not stale.exists(), "a checkpoint folder was left behind"
    other = tmp_path / ".book2.kv.segments"  # checkpoints that cannot be used: said, not silently redone
    other.mkdir()
    (other / "000000.kv").write_bytes(b"left from another run")
    r4 = subprocess.run(cmd[:4] + [str(tmp_path / "book2.kv")] + cmd[5:], env=env, capture_output=True, text=True,
                        timeout=300)  # fmt: skip
    assert r4.returncode == 0 and "none of the 1 segment checkpointed earlier matched this run" in r4.stderr, r4.stderr
    info = json.loads(subprocess.run([rocketkv_bin, "inspect", str(out), "--json"], capture_output=True, text=True,
                                     timeout=60).stdout)  # fmt: skip
    assert info["n_segments"] == row["n_segments"] and len(info["segments"]) == row["n_segments"]
    assert info["document_sha256"] == hashlib.sha256(doc.read_bytes()).hexdigest()
    a = subprocess.run([rocketkv_bin, "ask", "--cache", str(out), "which word?", "--json"], env=env,
                       capture_output=True, text=True, timeout=120)  # fmt: skip
    assert a.returncode == 0, a.stderr
    assert len(json.loads(a.stdout)["segments"]) == 1
    a = subprocess.run([rocketkv_bin, "ask", "--cache", str(out), "which word?", "why " * 3000], env=env,
                       capture_output=True, text=True, timeout=120)  # fmt: skip
    assert a.returncode == 1 and a.stdout == "", "a question was answered before a bad one was refused"
    a = subprocess.run([rocketkv_bin, "ask", "--cache", str(out), "which word?", "--segment", "999"], env=env,
                       capture_output=True, text=True, timeout=120)  # fmt: skip
    assert a.returncode == 1 and "out of range" in a.stderr


def test__cli_long_document_from_stdin_and_in_memory_ask_and_summarize(rocketkv_bin, tiny_model_dir, tmp_path):
    text = lines_text(40)  # ~2.2K tokens: 5+ segments of 512
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    common = ["--model", str(tiny_model_dir), "--segment-tokens", "512"]
    out = tmp_path / "stdin.kv"
    r = subprocess.run([rocketkv_bin, "ingest", "-", "-o", str(out), *common, "--budget", "64", "--json"], input=text,
                       env=env, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["n_segments"] >= 5
    assert load_cache(out).info.document_sha256 == hashlib.sha256(text.encode()).hexdigest()
    doc = tmp_path / "doc.txt"
    doc.write_text(text)
    r = subprocess.run([rocketkv_bin, "ask", str(doc), "which word?", *common, "--max-new-tokens", "3", "--json"],
                       env=env, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert len(json.loads(r.stdout)["segments"]) == 1
    r = subprocess.run([rocketkv_bin, "summarize", "--cache", str(out), "--max-new-tokens", "3", "--json"],
                       env=env, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert r.returncode == 0, r.stderr
    row = json.loads(r.stdout)
    n = json.loads(subprocess.run([rocketkv_bin, "inspect", str(out), "--json"], capture_output=True, text=True).stdout)
    assert [p["segment"] for p in row["partial_summaries"] if p["level"] == 0] == list(range(n["n_segments"]))
    assert row["n_answer_tokens"] <= 3 and "summary of part 1/" in r.stderr


def test__segmented_adaptive_layer_budgets__round_trip_and_answer(engine, tmp_path):
    """Each segment splits its own total over the layers; the merged and the saved book answer."""
    import dataclasses

    cfg = dataclasses.replace(CFG, layer_budgets="adaptive")
    stored = ingest_stream(engine, TextPieces(lines_text(30), "doc.txt"), cfg, segment_tokens=300)
    assert isinstance(stored, SegmentedKVCache) and len(stored.segments) > 1
    full = [i for i, s in enumerate(engine.shape.layers) if s.sliding_window is None]
    for seg in stored.segments:
        counts = [seg.layers[i].n_kept_tokens for i in full]
        assert sum(counts) == len(full) * seg.info.budgets.prompt_budget, counts
    loaded = load_cache(save_segmented(stored, tmp_path / "book.kv"))
    assert isinstance(loaded, SegmentedKVCache)
    for a, b in zip(stored.segments, loaded.segments):
        assert all(same_layer(la, lb) for la, lb in zip(a.layers, b.layers))
    merged = merge_segments(loaded, [0, len(loaded.segments) - 1])
    counts = [merged.layers[i].n_kept_tokens for i in full]
    assert sum(counts) == len(full) * merged.info.budgets.prompt_budget, counts
    a = next(answer(engine, merged, ["which line?"], 4, decode_config_for(merged)))
    assert a.n_answer_tokens >= 1


def test__cli_ingest_never_writes_checkpoints_through_a_planted_link(rocketkv_bin, tiny_model_dir, tmp_path):
    """A link planted where a segmented ingest keeps its checkpoints (`.OUT.segments`) made the
    ingest write its checkpoint files, and its owner line, into the folder linked to (a server's
    ingest too, outside its --allow-dir). Refused in one line, exit 1, nothing written there."""
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "owner").write_text("precious\n")
    (victim / "000000.kv").write_text("precious too\n")
    doc = tmp_path / "doc.txt"
    doc.write_text(lines_text(40))  # several 512-token segments
    out = tmp_path / "m.kv"
    (tmp_path / ".m.kv.segments").symlink_to(victim)
    r = subprocess.run([rocketkv_bin, "ingest", str(doc), "-o", str(out), "--model", str(tiny_model_dir),
                        "--segment-tokens", "512", "--budget", "64"], env={**os.environ, "HF_HUB_OFFLINE": "1"},
                       capture_output=True, text=True, timeout=300)  # fmt: skip
    assert r.returncode == 1, r.stderr
    errors = [line for line in r.stderr.splitlines() if line.startswith("Error:")]
    link = tmp_path / ".m.kv.segments"
    said = (f"Error: the checkpoint folder {link} is a symbolic link; rocketkv writes an ingest's checkpoints only "
            f"into a folder of its own — remove {link}")  # fmt: skip
    assert errors == [said], r.stderr
    assert "Traceback" not in r.stderr and not out.exists()
    assert sorted(p.name for p in victim.iterdir()) == ["000000.kv", "owner"]
    assert (victim / "owner").read_text() == "precious\n" and (victim / "000000.kv").read_text() == "precious too\n"


def test__cli_ingest_into_a_file_another_ingest_is_writing__refused_before_its_prefill(rocketkv_bin, tiny_model_dir,
                                                                                      tmp_path):  # fmt: skip
    """Two segmented ingests into one file, a second apart, both prefilled every segment before one
    failed ("was replaced while in use"). The second is refused at once, naming the first: the
    first holds a lock on its checkpoint folder's owner file while it runs. A lock given up (the
    ingest ended, failed, or its process died, whatever its pid or host) is taken over."""
    import fcntl

    from rocketkv_cli.store.atomic import host_tag

    doc = tmp_path / "doc.txt"
    doc.write_text(lines_text(40))  # several 512-token segments
    out, folder = tmp_path / "m.kv", tmp_path / ".m.kv.segments"
    folder.mkdir()
    held = open(folder / "owner", "w")  # noqa: SIM115  (held open: the lock lives as long as it does)
    held.write(f"{os.getpid()} {host_tag()}\n")
    held.flush()
    fcntl.flock(held, fcntl.LOCK_EX)  # as a running ingest holds it
    cmd = [rocketkv_bin, "ingest", str(doc), "-o", str(out), "--model", str(tiny_model_dir), "--segment-tokens", "512",
           "--budget", "64"]  # fmt: skip
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    errors = [line for line in r.stderr.splitlines() if line.startswith("Error:")]
    assert r.returncode == 1 and errors == [f"Error: another rocketkv ingest (pid {os.getpid()}) is writing {out} now "
                                            "— wait for it to finish (or stop it: a rerun resumes it), then run this "
                                            "again"], r.stderr  # fmt: skip
    assert "prefill" not in r.stderr and not out.exists() and os.listdir(folder) == ["owner"]
    held.close()  # the other ingest ended (a pid still running, or another host's, no longer matters)
    again = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0 and out.exists(), again.stderr


def test__an_ingest_that_failed_in_a_running_process__lets_a_rerun_elsewhere_resume(tiny_model_dir, rocketkv_bin,
                                                                                     tmp_path):  # fmt: skip
    """A segmented ingest that fails or is cancelled in a process that goes on (a server whose
    client left, a notebook's KeyboardInterrupt) gives up its claim: a rerun in another process
    resumes from its checkpoints instead of being refused for as long as that process lives."""
    from rocketkv_cli.api.rocketkv import RocketKV

    rk = RocketKV.load(str(tiny_model_dir), device="cpu")
    doc = tmp_path / "doc.txt"
    doc.write_text(lines_text(40))
    out = tmp_path / "m.kv"
    seen = []

    def progress(done: int, total: int) -> None:
        seen.append(done)
        if len(list((tmp_path / ".m.kv.segments").glob("*.kv"))) >= 1:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        rk.ingest(doc, output=out, token_budget=64, segment_tokens=512, progress=progress)
    r = subprocess.run([rocketkv_bin, "ingest", str(doc), "-o", str(out), "--model", str(tiny_model_dir),
                        "--segment-tokens", "512", "--budget", "64"], env={**os.environ, "HF_HUB_OFFLINE": "1"},
                       capture_output=True, text=True, timeout=300)  # fmt: skip
    assert r.returncode == 0 and "found checkpointed" in r.stderr, r.stderr


def test__checkpoints__a_link_planted_after_the_check_is_refused_before_a_write(tmp_path):
    """The link check ran once, before the prefill; a link planted during it was written through
    at the first save. Each save checks again (before the folder is claimed or written)."""
    from rocketkv_cli.errors import OutputError
    from rocketkv_cli.store.checkpoints import Checkpoints

    victim = tmp_path / "victim"
    victim.mkdir()
    checkpoints = Checkpoints(tmp_path / "m.kv")  # nothing there yet: accepted
    (tmp_path / ".m.kv.segments").symlink_to(victim)
    with pytest.raises(OutputError, match="is a symbolic link"):
        checkpoints.save(0, None)  # refused before the part is looked at
    assert list(victim.iterdir()) == []


def test__segment_routing_line__numbered_only_among_several_questions(engine):
    """ "question 1: answering from segment 2" for every chat turn through a server (each turn is
    one request of one question): one question's line has no number, several questions' do."""
    stored = ingest_stream(engine, TextPieces(lines_text(30), "doc.txt"), CFG, segment_tokens=300)
    said: list[str] = []
    list(answer_segmented(engine, stored, ["which word?"], 2, True, {}, segment=1, log=said.append))
    assert said == ["answering from segment 1"], said
    said.clear()
    list(answer_segmented(engine, stored, ["which word?", "what?"], 2, True, {}, segment=0, log=said.append))
    assert said == ["question 1: answering from segment 0", "question 2: answering from segment 0"], said
