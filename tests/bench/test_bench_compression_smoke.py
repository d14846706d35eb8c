"""`tensorwire bench compression` on a tiny run: every field of its JSON and its PNG exist."""

from __future__ import annotations

import math
from pathlib import Path

from tensorwire.bench import compression


def test_bench_compression_reports_every_codec_and_plots(tmp_path: Path) -> None:
    png = tmp_path / "out" / "compression.png"
    result = compression.main(["--codecs", "int8,topk:0.1+fp16", "--epochs", "1", "--size", "262144",
                               "--repeats", "1", "--plot", str(png), "--json"])  # fmt: skip
    assert set(result["codecs"]) == {"int8", "topk:0.1+fp16"}
    for row in result["codecs"].values():
        for key in ("bytes_ratio", "encode_gbps", "decode_gbps", "accuracy_ef", "accuracy_no_ef"):
            assert math.isfinite(row[key]) and row[key] > 0, key
    assert 0.24 < result["codecs"]["int8"]["bytes_ratio"] < 0.26
    assert result["codecs"]["topk:0.1+fp16"]["bytes_ratio"] < 0.2
    assert set(result["pull"]) == {"int8", "bf16"} and result["pull"]["int8"]["bytes_ratio"] < 0.26
    assert result["targets"]["topk_0.01_ef_10x_within_1pt"] is None  # not run
    assert png.read_bytes().startswith(b"\x89PNG")
