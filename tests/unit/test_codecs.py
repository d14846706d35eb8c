"""Codecs (tensorwire.compression): round-trip bounds, dtypes and shapes, payload sizes, names,
hostile payloads; error feedback tracking the true gradient sum where plain top-k drifts."""

from __future__ import annotations

import math

import pytest
import torch

from tensorwire.compression import Codec, ErrorFeedback, Int8, TopK, codec_for
from tensorwire.compression.codecs import from_wire, resolve, top_indices
from tensorwire.errors import InvalidTensor, ProtocolError

NAMES = ["fp32", "fp16", "bf16", "int8", "int8:stochastic", "int8:stochastic:100", "topk:0.01",
         "topk:0.1+fp16", "topk:0.05+int8", "topk:0.2+sign", "sign"]  # fmt: skip
DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
SIZES = [1, 7, 8, 9, 1000, 4097, 70_001]  # odd tails for sign (8) and int8 (4096) chunks; a
# top-k large enough to take the sampled-threshold path


def roundtrip(codec: Codec, x: torch.Tensor) -> torch.Tensor:
    payload = codec.encode(x)
    assert payload.dtype == torch.uint8 and payload.dim() == 1
    assert payload.numel() == codec.payload_bytes(x.numel())
    out = torch.empty_like(x)
    assert codec.decode(payload, out) is out
    return out


def sample(n: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(seed)).to(dtype)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_dtype_shape_empty_and_0dim_survive(name: str, dtype: torch.dtype) -> None:
    codec = codec_for(name)
    for shape in [(), (0,), (3, 0), (5, 7), (2, 3, 4), (1,)]:
        x = (
            torch.full(shape, 1.5, dtype=dtype)
            if shape == ()
            else sample(math.prod(shape), dtype).view(shape)
        )
        out = roundtrip(codec, x)
        assert out.dtype == dtype and out.shape == x.shape
    scalar = torch.tensor(-2.5, dtype=dtype)
    assert roundtrip(codec, scalar).item() == pytest.approx(
        -2.5, rel=1e-6
    )  # one element: kept (float32 scales)
    assert codec.encode(torch.empty(0, dtype=dtype)).numel() == 0


@pytest.mark.parametrize("n", SIZES)
def test_exact_and_cast_bounds(n: int) -> None:
    x = sample(n, torch.float32) * 100
    assert torch.equal(roundtrip(codec_for("fp32"), x), x)
    for dtype in (torch.float16, torch.bfloat16):
        assert torch.equal(roundtrip(codec_for("fp32"), x.to(dtype)), x.to(dtype))  # exact on narrower floats
    fp16 = roundtrip(codec_for("fp16"), x)
    assert ((fp16 - x).abs() <= x.abs() * 2**-11 + 2**-25).all()
    bf16 = roundtrip(codec_for("bf16"), x)
    assert ((bf16 - x).abs() <= x.abs() * 2**-8).all()


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("chunk", [4096, 100])
def test_int8_bounds_per_chunk(n: int, chunk: int) -> None:
    x = sample(n, torch.float32, seed=n) * torch.logspace(-3, 3, n)  # chunks of very different scales
    amax = _chunk_amax(x, chunk)
    nearest = roundtrip(Int8(chunk=chunk), x)
    assert ((nearest - x).abs() <= amax / 254 * (1 + 1e-4)).all()  # + float32 rounding
    stochastic = roundtrip(Int8(stochastic=True, chunk=chunk), x)
    assert ((stochastic - x).abs() < amax / 127 * (1 + 1e-4)).all()


def _chunk_amax(x: torch.Tensor, chunk: int) -> torch.Tensor:
    padded = torch.cat([x.abs(), x.new_zeros(-len(x) % chunk)]).view(-1, chunk)
    return padded.amax(1).repeat_interleave(chunk)[: len(x)]


def test_int8_stochastic_rounding_is_unbiased() -> None:
    x = torch.full((4096,), 0.3)
    x[0] = 1.0  # scale 1/127: 0.3 lies between two steps, 38.1 of them
    mean = torch.stack([roundtrip(codec_for("int8:stochastic"), x) for _ in range(400)]).mean(0)
    nearest = roundtrip(codec_for("int8"), x)
    assert abs(float(mean[1:].mean()) - 0.3) < 2e-4  # averages to x ...
    assert abs(float(nearest[1]) - 0.3) > 5e-4  # ... where nearest rounding stays off by a fixed bias


@pytest.mark.parametrize("n", SIZES)
def test_topk_keeps_exactly_the_largest(n: int) -> None:
    x = sample(n, torch.float32, seed=n)
    codec = TopK(0.01)
    out = roundtrip(codec, x)
    k = codec.k(n)
    kept = out != 0
    assert int(kept.sum()) == k and torch.equal(out[kept], x[kept])
    kth = x.abs().topk(k).values[-1]
    assert (x.abs()[kept] >= kth).all() and (x.abs()[~kept] <= kth).all()
    assert codec.payload_bytes(n) == 8 * k  # int32 index + float32 value


def test_topk_threshold_path_matches_full_topk() -> None:
    for seed in range(5):
        x = sample(1 << 18, torch.float32, seed) * torch.linspace(0.1, 10, 1 << 18)
        for k in (1, 100, 2621, 26214, 200_000):
            fast = set(top_indices(x, k).tolist())
            exact = set(torch.topk(x.abs(), k).indices.tolist())
            assert fast == exact


def test_topk_ties_and_nans_still_keep_exactly_k() -> None:
    x = torch.ones(1 << 17)
    x[::3] = 2.0  # 43,691 twos, the rest ones: k cuts through the ones
    for k in (10, 43_691, 50_000, 1 << 17):
        index = top_indices(x, k)
        assert index.numel() == k == len(set(index.tolist()))
        assert int((x[index] == 2).sum()) == min(k, 43_691)
    x[5] = float("nan")
    assert top_indices(x, 100).numel() == 100


def test_topk_composed_values_go_through_the_inner_codec() -> None:
    x = sample(10_000, torch.float32) * 1000
    codec = codec_for("topk:0.1+fp16")
    out = roundtrip(codec, x)
    kept = out != 0
    assert int(kept.sum()) == 1000
    assert ((out[kept] - x[kept]).abs() <= x[kept].abs() * 2**-11).all()
    assert codec.payload_bytes(10_000) == 1000 * (4 + 2)


@pytest.mark.parametrize("n", SIZES)
def test_sign_keeps_signs_and_the_l1_norm(n: int) -> None:
    x = sample(n, torch.float32, seed=n)
    out = roundtrip(codec_for("sign"), x)
    assert torch.equal(out < 0, x < 0)
    assert torch.allclose(out.abs(), x.abs().mean().expand(n))
    assert codec_for("sign").payload_bytes(n) == 4 + -(-n // 8)


def test_names_parse_to_canonical_wire_names() -> None:
    for name in NAMES:
        assert codec_for(name).name == name
    assert codec_for("int8:nearest:4096").name == "int8"
    assert codec_for("topk:0.010+fp32").name == "topk:0.01"
    assert resolve(None) is None and resolve("none") is None
    assert codec_for("sign").lossy and not codec_for("fp32").lossy
    assert codec_for("topk:0.5").sparse and not codec_for("int8").sparse
    for bad in ["zip", "int8:fast", "int8:0", "topk", "topk:0", "topk:2", "topk:x", "topk:nan",
                "fp16+int8", "topk:0.1+topk:0.1", "sign:1", "x" * 80]:  # fmt: skip
        with pytest.raises(ValueError):
            codec_for(bad)
    with pytest.raises(ProtocolError):
        from_wire("lz4")


def test_hostile_payloads_are_refused() -> None:
    codec = TopK(0.5)
    payload = codec.encode(torch.ones(4))
    payload[:4].view(torch.int32)[0] = 99  # an index past the end
    with pytest.raises(InvalidTensor, match="indexes"):
        codec.decode(payload, torch.empty(4))
    payload[:4].view(torch.int32)[0] = -1
    with pytest.raises(InvalidTensor):
        codec.decode(payload, torch.empty(4))
    with pytest.raises(InvalidTensor, match="bytes"):
        codec_for("int8").decode(torch.zeros(3, dtype=torch.uint8), torch.empty(10))
    with pytest.raises(InvalidTensor):
        codec_for("fp16").encode(torch.ones(3, dtype=torch.int64))
    with pytest.raises(InvalidTensor):
        codec_for("fp16").decode(torch.zeros(4, dtype=torch.uint8), torch.empty(4, 2).t())  # not contiguous


def test_error_feedback_tracks_the_true_sum_where_plain_topk_drifts() -> None:
    """Over many steps the sum of what error feedback sent equals the sum of the true gradients
    minus the last residual (which stays bounded); plain top-k loses the small coordinates for good."""
    gen = torch.Generator().manual_seed(0)
    n, steps = 1000, 300
    bias = torch.linspace(-0.05, 0.05, n)  # a small, steady signal under noise: what top-k drops
    codec = codec_for("topk:0.01")
    feedback = ErrorFeedback(codec)
    true_sum, ef_sum, plain_sum = torch.zeros(n), torch.zeros(n), torch.zeros(n)
    residual_norms = []
    for _ in range(steps):
        grad = bias + torch.randn(n, generator=gen)
        true_sum += grad
        plain = torch.empty(n)
        plain_sum += codec.decode(codec.encode(grad), plain)
        sent = grad.clone()
        feedback.encode("g", sent)
        ef_sum += sent
        residual_norms.append(float(feedback.residuals["g"].norm()))
    residual = feedback.residuals["g"]
    assert torch.allclose(ef_sum + residual, true_sum, atol=1e-3)  # nothing lost, only delayed
    assert max(residual_norms[steps // 2 :]) < 1.5 * max(residual_norms[: steps // 2])  # bounded
    ef_error = float((ef_sum - true_sum).norm() / true_sum.norm())
    plain_error = float((plain_sum - true_sum).norm() / true_sum.norm())
    assert ef_error < 0.5 * plain_error, (ef_error, plain_error)
    assert plain_error > 0.5  # top-k alone dropped most of the signal
    assert feedback.nbytes == n * 4
