"""Lossless chunk codecs and the per-chunk policy (wire/lossless.py), and HELLO's compression field."""

from __future__ import annotations

import pytest
import torch

from tensorwire import errors
from tensorwire.types import Limits
from tensorwire.wire import lossless
from tensorwire.wire import meta as wm
from tensorwire.wire.tensors import byte_view

CHUNK = 4 << 20


def _sparse(n: int = CHUNK // 4) -> memoryview:
    x = torch.zeros(n)
    x[::10] = torch.randn(x[::10].numel())  # a sparse gradient: ~90% zeros
    return byte_view(x)


@pytest.mark.parametrize("codec", [lossless.Codec.LZ4, lossless.Codec.ZSTD])
def test_codecs_round_trip_and_refuse_damage(codec: int) -> None:
    data = bytes(_sparse(1 << 16))
    packed = lossless.compress(codec, data)
    assert len(packed) < len(data) / 2
    assert lossless.decompress(codec, packed, len(data)) == data
    with pytest.raises(errors.CorruptFrame):
        lossless.decompress(codec, packed, len(data) + 1)  # a size that does not match
    with pytest.raises(errors.CorruptFrame):
        lossless.decompress(codec, b"\xff" * 64, len(data))
    with pytest.raises(errors.CorruptFrame):
        lossless.decompress(7, packed, len(data))  # no such codec


def test_incompressible_chunks_are_detected_by_a_probe_and_sent_raw() -> None:
    encoder = lossless.Encoder("lz4")
    frame = encoder.frame()
    noise = byte_view(torch.randn(CHUNK // 4))
    for _ in range(1 + lossless.SKIP_AFTER_MISS):
        codec, payload = frame.encode([noise])
        assert codec == lossless.Codec.RAW and payload[0] is noise  # raw, and not copied
    assert encoder.stats.compressed == 0
    codec, payload = frame.encode([_sparse()])  # probed again after the skip: compressible now
    assert codec == lossless.Codec.LZ4 and len(payload[0]) < CHUNK / 2
    assert encoder.stats.compressed == 1 and encoder.stats.wire_bytes < encoder.stats.raw_bytes


def test_auto_compresses_only_when_the_codec_beats_the_link() -> None:
    slow = lossless.Encoder("auto", lossless.LinkMeter(bps=50e6))  # a 400 Mbit/s link
    frame = slow.frame()
    assert all(frame.encode([_sparse()])[0] == lossless.Codec.LZ4 for _ in range(3))
    fast = lossless.Encoder("auto", lossless.LinkMeter(bps=1e13))  # faster than any codec
    frame = fast.frame()
    assert frame.encode([_sparse()])[0] == lossless.Codec.LZ4  # measured once, already paid for
    assert frame.encode([_sparse()])[0] == lossless.Codec.RAW
    assert fast.frame().encode([_sparse()])[0] == lossless.Codec.RAW  # the next frames too, for a while
    assert fast.auto_skip == lossless.AUTO_RECHECK - 1


def test_auto_sends_in_the_plain_framing_while_compression_does_not_pay() -> None:
    """After auto finds data incompressible, its next frames skip the compressed framing (no chunk
    heads, no probes) until AUTO_RECHECK chunks have gone by: then it costs what "none" does."""
    encoder = lossless.Encoder("auto", lossless.LinkMeter(bps=50e6))
    assert not encoder.plain(32)  # nothing learned yet: the first frame is probed
    assert encoder.frame().encode([byte_view(torch.randn(CHUNK // 4))])[0] == lossless.Codec.RAW
    frames = lossless.AUTO_RECHECK // 32
    assert all(encoder.plain(32) for _ in range(frames))
    assert not encoder.plain(32)  # and then it looks again
    assert not lossless.Encoder("lz4").plain(32)  # an explicit codec always uses the framing


def test_link_meter_ignores_small_sends_and_smooths() -> None:
    meter = lossless.LinkMeter()
    assert meter.estimate == lossless.DEFAULT_LINK_BPS
    meter.observe(1000, 1e-6)
    assert meter.bps == 0.0
    meter.observe(100 << 20, 0.1)
    first = meter.bps
    meter.observe(100 << 20, 0.05)
    assert first < meter.bps < 2 * first


def test_modes_are_checked() -> None:
    assert lossless.check_mode("auto") == "auto"
    with pytest.raises(ValueError, match="compression must be one of"):
        lossless.check_mode("gzip")


def test_hello_carries_compression_only_when_asked() -> None:
    limits = Limits()
    plain = wm.encode_hello_request(1, 1)
    assert wm.decode_hello_request(wm.MetaReader(plain, limits)) == (1, 1, None, None)
    asked = wm.Compression(lossless.SUPPORTED_MASK, lossless.AUTO)
    for token in (None, "secret"):
        block = wm.encode_hello_request(1, 1, token, asked)
        assert wm.decode_hello_request(wm.MetaReader(block, limits)) == (1, 1, token, asked)
    info = wm.ServerInfo(1, limits, 1 << 30, 0, lossless.SUPPORTED_MASK)
    assert len(wm.encode_hello_response(info)) == 48  # an old client sees the block it knows
    answer = wm.encode_hello_response(info, with_codecs=True)
    assert wm.decode_hello_response(wm.MetaReader(answer, limits)) == info


def test_threads_compress_and_decompress_zstd_at_once() -> None:
    """Each thread has its own zstd contexts: a server compresses delta answers on worker threads
    while its event loop compresses frames, and one shared compressor crashed the process."""
    import threading

    chunks = [bytes(range(256)) * (1024 + 64 * i) for i in range(8)]
    errors: list[BaseException] = []
    start = threading.Barrier(len(chunks))

    def work(chunk: bytes) -> None:
        try:
            start.wait(10)
            for _ in range(50):
                packed = lossless.compress(lossless.Codec.ZSTD, chunk)
                assert lossless.decompress(lossless.Codec.ZSTD, packed, len(chunk)) == chunk
        except BaseException as exc:  # reported below, not lost in the thread
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(chunk,)) for chunk in chunks]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert not errors and not any(t.is_alive() for t in threads)
    contexts: list[object] = []
    probe = threading.Thread(target=lambda: contexts.append(lossless._zstd_compressor()))
    probe.start()
    probe.join(10)
    assert contexts and contexts[0] is not lossless._zstd_compressor()
