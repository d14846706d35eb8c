"""Lossy codecs for gradients (pushed) and weights (pulled): each turns a float tensor into a
payload of bytes and back.

A codec is named by its *wire name*, which travels with every compressed frame
(docs/protocol.md §13.6), so the receiver builds the same codec with ``codec_for(name)``:

* ``fp32``: n float32. Exact on fp32 (and fp16, bf16) tensors.
* ``fp16``: n float16. Error ≤ 2^-11·|x| + 2^-25 for |x| ≤ 65504.
* ``bf16``: n bfloat16. Error ≤ 2^-8·|x|.
* ``int8[:nearest|:stochastic][:C]``: ceil(n/C) float32 scales (max |x| of the chunk / 127),
  then n int8; C = 4096 elements by default. Error ≤ amax/254 per chunk with nearest rounding,
  < amax/127 with stochastic rounding, which is unbiased (E[decoded] = x).
* ``topk:<r>[+<codec>]``: k = min(n, max(1, ceil(r·n))) int32 indices (int64 if n ≥ 2^31),
  ascending (a receiver refuses an index named twice), then the k kept values in ``<codec>``
  (fp32 if none). Kept elements: the inner codec's error;
  the others decode to 0, and each of them is at most the k-th largest |x|.
* ``sign``: one float32 scale, mean |x|, then ceil(n/8) bytes of sign bits (bit i of byte j set:
  element 8j+i is negative). Decodes to ±mean |x|: signs kept, the L1 norm kept.

Every payload size is a function of the codec and n alone (``payload_bytes``), so a receiver
knows how many bytes each tensor takes before it reads one, and refuses a frame whose sizes do not
add up. All multi-byte fields are little-endian, and the fields that need alignment come first.

Lifecycle: the sender calls ``encode(tensor)`` and sends the returned 1-D uint8 tensor; the
receiver allocates ``payload_bytes(numel)`` bytes, receives into them, and calls
``decode(payload, out)``, which writes into ``out`` (any float dtype, contiguous) in place.
Both are vectorised torch code (no Python loop over elements) and run on the tensor's device (a
CUDA gradient is encoded there, its payload made there); decode is deterministic, so every
receiver of the same payload gets the same bits (a primary and its backups stay identical).
Payloads come from peers: decode writes only into the ``out`` it is given (its size the
receiver's choice, never the payload's), and refuses (InvalidTensor) a payload no encoder writes:
a top-k index out of range or named twice, an int8 or sign scale that is negative, inf or NaN.
"""

from __future__ import annotations

import functools
import math
import threading
from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence

import torch

from tensorwire.errors import InvalidTensor, ProtocolError

MAX_NAME_BYTES = 64
INT8_CHUNK = 4096  # elements per int8 scale: 4 bytes of scale per 4 KiB of int8, 0.1 %
_U8 = torch.uint8
_SIGN_MAGIC = 0x0102040810204080  # gathers the low bit of 8 bytes into the top byte of a u64
_SAMPLE = 16384  # elements top-k samples to guess its threshold


_local = threading.local()


def scratch(slot: str, numel: int, dtype: torch.dtype, device: torch.device | None = None) -> torch.Tensor:
    """A temporary of ``numel`` elements (on ``device``, the CPU by default), reused by this
    thread's next call for the same slot and device.

    Fresh pages cost more than the arithmetic (a new 16 MiB tensor is ~4,000 page faults), so the
    codecs keep their temporaries: a thread that encodes holds about 1.25x the largest tensor it
    encoded (a float temporary and a mask), until it ends."""
    pool: dict[tuple[str, torch.device | None], torch.Tensor] = _local.__dict__.setdefault("pool", {})
    need = numel * dtype.itemsize
    key = (slot, None if device is None or device.type == "cpu" else device)
    buffer = pool.get(key)
    if buffer is None or buffer.numel() < need:
        buffer = pool[key] = torch.empty(need, dtype=_U8, device=device)
    return buffer[:need].view(dtype)


NOISE_ELEMENTS = 1 << 20  # stochastic rounding's table of U[0, 1) noise (4 MiB, made once per thread)


def _add_uniform_noise(y: torch.Tensor) -> None:
    """Add U[0, 1) noise to each element of the contiguous 1-D ``y``, at memory speed.

    Drawing a random number per element (``torch.rand``) costs more than the rest of the int8
    encode together. Stochastic rounding needs each element's noise uniform, which keeps it
    unbiased (E[floor(v + u)] = v); it does not need the elements independent of each other. So
    the noise comes from a per-thread table of 2^20 draws, rotated by a fresh random offset each
    call and repeated over the tensor: elements 2^20 apart get the same noise within one call."""
    tables: dict[torch.device, torch.Tensor] = _local.__dict__.setdefault("noise", {})
    table = tables.get(y.device)
    if table is None:
        table = tables[y.device] = torch.rand(2 * NOISE_ELEMENTS)[:NOISE_ELEMENTS].clone().to(y.device)
    start = int(torch.randint(NOISE_ELEMENTS, ()).item())
    window = scratch("noise", NOISE_ELEMENTS, torch.float32, y.device)
    window[: NOISE_ELEMENTS - start].copy_(table[start:])
    window[NOISE_ELEMENTS - start :].copy_(table[:start])
    n = y.numel()
    whole = n // NOISE_ELEMENTS * NOISE_ELEMENTS
    if whole:
        y[:whole].view(-1, NOISE_ELEMENTS).add_(window)
    y[whole:].add_(window[: n - whole])


class Codec(ABC):
    """One way of turning a float tensor into bytes and back (see the module doc).

    ``lossy``: decode(encode(x)) may differ from x (error feedback applies). ``sparse``: it drops
    elements outright (top-k), so it is for gradients only, never for weights.
    """

    name: str
    lossy: bool = True
    sparse: bool = False

    @abstractmethod
    def payload_bytes(self, numel: int) -> int:
        """The exact size of the payload of a tensor of ``numel`` elements."""

    @abstractmethod
    def _encode(self, flat: torch.Tensor) -> torch.Tensor: ...

    @abstractmethod
    def _decode(self, payload: torch.Tensor, out: torch.Tensor) -> None: ...

    def encode(self, tensor: torch.Tensor) -> torch.Tensor:
        """The payload of ``tensor`` (any float dtype and shape): a 1-D uint8 tensor."""
        if not tensor.dtype.is_floating_point or tensor.is_complex():
            raise InvalidTensor(f"codec {self.name} encodes floating-point tensors, not {tensor.dtype}")
        flat = tensor.detach().reshape(-1)
        if flat.numel() == 0:
            return torch.empty(0, dtype=_U8, device=flat.device)
        payload = self._encode(flat)
        assert payload.numel() == self.payload_bytes(flat.numel()), self.name
        return payload

    def decode(self, payload: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """Write the tensor ``payload`` encodes into ``out`` (its dtype and shape stay); return it."""
        if not out.dtype.is_floating_point or out.is_complex() or not out.is_contiguous():
            raise InvalidTensor(f"codec {self.name} decodes into a contiguous float tensor, not {out.dtype}")
        expected = self.payload_bytes(out.numel())
        if payload.dtype != _U8 or payload.dim() != 1 or payload.numel() != expected:
            raise InvalidTensor(
                f"a {self.name} payload of {out.numel()} elements has {expected} bytes, "
                f"not {payload.numel() * payload.element_size()}"
            )
        if out.numel():
            self._decode(payload, out.view(-1))
        return out

    def __repr__(self) -> str:
        return f"<codec {self.name}>"


class Cast(Codec):
    """``fp32``, ``fp16``, ``bf16``: a cast to a narrower float (``fp32`` is exact on fp32)."""

    def __init__(self, name: str, dtype: torch.dtype) -> None:
        self.name, self.dtype = name, dtype
        self.lossy = dtype != torch.float32
        self._size = dtype.itemsize

    def payload_bytes(self, numel: int) -> int:
        return numel * self._size

    def _encode(self, flat: torch.Tensor) -> torch.Tensor:
        payload = torch.empty(flat.numel() * self._size, dtype=_U8, device=flat.device)
        payload.view(self.dtype).copy_(flat)
        return payload

    def _decode(self, payload: torch.Tensor, out: torch.Tensor) -> None:
        out.copy_(payload.view(self.dtype))


class Int8(Codec):
    """Symmetric int8 with one float32 scale (max ``|x|`` / 127) per chunk of ``chunk`` elements;
    nearest rounding, or stochastic rounding (unbiased: E[decode] = x)."""

    def __init__(self, stochastic: bool = False, chunk: int = INT8_CHUNK) -> None:
        if chunk < 1:
            raise ValueError(f"int8 chunk must be at least 1 element, not {chunk}")
        self.stochastic, self.chunk = stochastic, chunk
        self.name = (
            "int8" + (":stochastic" if stochastic else "") + (f":{chunk}" if chunk != INT8_CHUNK else "")
        )

    def payload_bytes(self, numel: int) -> int:
        return 4 * -(-numel // self.chunk) + numel

    def _rows(self, flat: torch.Tensor) -> list[tuple[slice, torch.Tensor]]:
        """The whole chunks as one 2-D view and the last partial chunk (no padding copy)."""
        full = flat.numel() // self.chunk * self.chunk
        rows = [(slice(0, full), flat[:full].view(-1, self.chunk))] if full else []
        if full < flat.numel():
            rows.append((slice(full, flat.numel()), flat[full:].view(1, -1)))
        return rows

    def _encode(self, flat: torch.Tensor) -> torch.Tensor:
        n = flat.numel()
        chunks = -(-n // self.chunk)
        payload = torch.empty(self.payload_bytes(n), dtype=_U8, device=flat.device)
        scales, q = payload[: 4 * chunks].view(torch.float32), payload[4 * chunks :].view(torch.int8)
        at = 0
        for where, x in self._rows(flat):
            amax = torch.maximum(x.amax(1), x.amin(1).neg()).float()
            scales[at : at + len(amax)] = amax / 127
            inv = torch.where(amax > 0, 127 / amax, 0.0)
            y = scratch("int8", x.numel(), torch.float32, x.device).view(x.shape)
            torch.mul(x, inv[:, None], out=y)
            if self.stochastic:
                _add_uniform_noise(y.view(-1))
                y.floor_()
            else:
                y.round_()
            q[where].view(y.shape).copy_(y.clamp_(-127, 127))  # clamp: x·(127/amax) may round past 127
            at += len(amax)
        return payload

    def _decode(self, payload: torch.Tensor, out: torch.Tensor) -> None:
        chunks = -(-out.numel() // self.chunk)
        scales, q = payload[: 4 * chunks].view(torch.float32), payload[4 * chunks :].view(torch.int8)
        _check_scales(self.name, scales)
        at = 0
        for where, o in self._rows(out):
            s = scales[at : at + o.shape[0], None]
            torch.mul(q[where].view(o.shape), s if o.dtype == torch.float32 else s.to(o.dtype), out=o)
            at += o.shape[0]


class TopK(Codec):
    """The ``ratio`` fraction of elements largest in magnitude, as (index, value) pairs; the
    values go through ``inner`` (``topk:0.01+fp16``). Decoding writes zeros elsewhere."""

    sparse = True

    def __init__(self, ratio: float, inner: Codec | None = None) -> None:
        if not 0 < ratio <= 1 or not math.isfinite(ratio):
            raise ValueError(f"top-k ratio must be in (0, 1], not {ratio}")
        if inner is not None and inner.sparse:
            raise ValueError(f"top-k values cannot be encoded by another sparse codec ({inner.name})")
        self.ratio, self.inner = ratio, inner or Cast("fp32", torch.float32)
        self.name = f"topk:{ratio:g}" + (
            f"+{inner.name}" if inner is not None and inner.name != "fp32" else ""
        )

    def k(self, numel: int) -> int:
        return min(numel, max(1, math.ceil(self.ratio * numel))) if numel else 0

    @staticmethod
    def _index_dtype(numel: int) -> torch.dtype:
        return torch.int32 if numel < 1 << 31 else torch.int64

    def payload_bytes(self, numel: int) -> int:
        k = self.k(numel)
        return k * self._index_dtype(numel).itemsize + self.inner.payload_bytes(k)

    def _encode(self, flat: torch.Tensor) -> torch.Tensor:
        n, k = flat.numel(), self.k(flat.numel())
        index = top_indices(flat, k).sort().values  # ascending: the receiver checks them in one pass
        values = self.inner.encode(flat[index])
        isize = self._index_dtype(n).itemsize
        payload = torch.empty(k * isize + values.numel(), dtype=_U8, device=flat.device)
        payload[: k * isize].view(self._index_dtype(n)).copy_(index)
        payload[k * isize :].copy_(values)
        return payload

    def _decode(self, payload: torch.Tensor, out: torch.Tensor) -> None:
        n, k = out.numel(), self.k(out.numel())
        isize = self._index_dtype(n).itemsize
        index = payload[: k * isize].view(self._index_dtype(n))
        low, high = torch.aminmax(index)
        if low < 0 or high >= n:  # from the wire: never index outside ``out``
            raise InvalidTensor(f"a {self.name} payload indexes element {int(high)} of {n}")
        # An element named twice would be written in an unspecified order (replicas that decode
        # the same payload could differ): refused. Ascending indices are checked in one pass.
        if k > 1 and not bool((index[1:] > index[:-1]).all()) and torch.unique(index).numel() != k:
            raise InvalidTensor(f"a {self.name} payload names the same element twice")
        kept = torch.empty(k, dtype=out.dtype, device=out.device)
        values = self.inner.decode(payload[k * isize :], kept)
        out.zero_()
        out[index] = values


def _check_scales(name: str, scales: torch.Tensor) -> None:
    """A payload's scales come from a peer: a negative, infinite or NaN one (which no encoder
    writes) would make every element of its chunk garbage, so the payload is refused."""
    if scales.numel() and not bool(torch.isfinite(scales).all() and (scales >= 0).all()):
        raise InvalidTensor(f"a {name} payload has a scale that is negative, infinite or NaN")


def top_indices(flat: torch.Tensor, k: int) -> torch.Tensor:
    """The indices of the ``k`` elements of ``flat`` largest in magnitude (in no order).

    ``torch.topk`` over all n elements is slow on a CPU (a partial sort). Instead a threshold is
    guessed from a strided sample so that it keeps k candidates and a few more (four standard
    deviations of the guess), in one pass; the exact k are then chosen among those by a selection
    (``kthvalue``), ties at the k-th value broken by position. A guess that keeps fewer than k
    (unlucky, or NaNs) falls back to ``torch.topk`` over everything."""
    n = flat.numel()
    magnitude = torch.abs(flat, out=scratch("magnitude", n, flat.dtype, flat.device))
    if n <= 4 * _SAMPLE or k == n:
        return torch.topk(magnitude, k, sorted=False).indices
    # An odd stride, so that the sample of a (rows, 2^m) gradient does not keep to a few columns.
    sample = magnitude[:: n // _SAMPLE | 1]
    m = sample.numel()
    hits = k * m / n  # sampled elements expected among the top k
    rank = m - math.ceil(hits + 4 * math.sqrt(hits) + 1)
    candidates = None
    if rank >= 1:
        candidates = _at_least(magnitude, torch.kthvalue(sample, rank).values, dense=32 * k > n)
    chosen = (
        _exact_top(magnitude, k) if candidates is None else candidates[_exact_top(magnitude[candidates], k)]
    )
    if chosen.numel() != k:
        return torch.topk(magnitude, k, sorted=False).indices
    return chosen


def _at_least(magnitude: torch.Tensor, threshold: torch.Tensor, dense: bool = False) -> torch.Tensor:
    """Indices (ascending) of the elements >= ``threshold``. ``nonzero`` over n bools is the slow
    step, so when hits are sparse it runs over the mask's u64 words (8 bools each) and then over
    the few hit words; ``dense`` (more than ~1 in 32 elements expected) goes straight over n."""
    n = magnitude.numel()
    mask = scratch("mask", -(-n // 8) * 8, torch.bool, magnitude.device)
    torch.ge(magnitude, threshold, out=mask[:n])
    if dense:  # most words hold a hit: the word pass would only add a second full pass
        return torch.nonzero(mask[:n]).squeeze(1)
    mask[n:].zero_()
    hit = torch.nonzero(mask.view(torch.uint8).view(torch.int64)).squeeze(1)
    rows, cols = torch.nonzero(mask.view(-1, 8)[hit]).unbind(1)
    return hit[rows] * 8 + cols


def _exact_top(values: torch.Tensor, k: int) -> torch.Tensor:
    """Positions of the k largest ``values`` (fewer when there are not k comparable ones)."""
    m = values.numel()
    if m <= k:
        return torch.arange(m, device=values.device)
    kth = torch.kthvalue(values, m - k + 1).values
    above = torch.nonzero(values > kth).squeeze(1)
    ties = torch.nonzero(values == kth).squeeze(1)[: k - above.numel()]
    return torch.cat([above, ties])


class Sign(Codec):
    """One bit per element (its sign) and one scale, mean ``|x|``: decode(x) = ±mean ``|x|`` (scaled
    signSGD, which with error feedback converges like SGD)."""

    name = "sign"

    def payload_bytes(self, numel: int) -> int:
        return 4 + -(-numel // 8) if numel else 0

    def _encode(self, flat: torch.Tensor) -> torch.Tensor:
        n = flat.numel()
        payload = torch.empty(self.payload_bytes(n), dtype=_U8, device=flat.device)
        wide = torch.float64 if flat.dtype == torch.float64 else torch.float32  # fp16 sums overflow
        magnitude = torch.abs(flat, out=scratch("magnitude", n, flat.dtype, flat.device))
        payload[:4].view(torch.float32)[0] = magnitude.sum(dtype=wide) / n
        negative = torch.lt(flat, 0, out=scratch("mask", n, torch.bool, flat.device))
        main = n // 8 * 8
        if main:  # 8 bools (bytes of 0/1) as one u64: a multiply gathers them into one byte
            words = negative[:main].view(torch.uint8).view(torch.int64)
            payload[4 : 4 + main // 8].copy_(((words * _SIGN_MAGIC) >> 56) & 0xFF)
        if main < n:
            tail = negative[main:].to(_U8) << torch.arange(n - main, dtype=_U8, device=flat.device)
            payload[-1] = tail.sum(dtype=torch.int64)
        return payload

    def _decode(self, payload: torch.Tensor, out: torch.Tensor) -> None:
        n = out.numel()
        _check_scales(self.name, payload[:4].view(torch.float32))
        scale = payload[:4].view(torch.float32)[0].to(out.dtype)
        bits = torch.arange(8, dtype=_U8, device=out.device)
        # One row per byte value: its 8 elements, -scale where the bit is set, +scale elsewhere.
        byte = torch.arange(256, dtype=_U8, device=out.device)
        table = torch.where((byte[:, None] >> bits) & 1 == 1, -scale, scale)
        packed = payload[4:].long()
        main = n // 8 * 8
        if main:
            torch.index_select(table, 0, packed[: main // 8], out=out[:main].view(-1, 8))
        if main < n:
            out[main:] = table[packed[-1], : n - main]


@functools.lru_cache(maxsize=64)
def codec_for(name: str) -> Codec:
    """The codec a wire name stands for (see the module doc); ValueError for an unknown one."""
    if len(name.encode()) > MAX_NAME_BYTES:
        raise ValueError(f"codec name of {len(name.encode())} bytes exceeds {MAX_NAME_BYTES}")
    first, plus, rest = name.partition("+")
    if plus:
        head = codec_for(first)
        if not isinstance(head, TopK) or head.inner.name != "fp32":
            raise ValueError(f"only topk:<ratio> composes with a value codec (topk:0.01+fp16), not {name!r}")
        return TopK(head.ratio, codec_for(rest))
    kind, _, args = name.partition(":")
    if kind in _CASTS and not args:
        return Cast(kind, _CASTS[kind])
    if kind == "sign" and not args:
        return Sign()
    if kind == "int8":
        return _int8(args, name)
    if kind == "topk" and args:
        try:
            ratio = float(args)
        except ValueError:
            raise ValueError(f"top-k ratio must be a number, not {args!r}") from None
        return TopK(ratio)
    raise ValueError(f"unknown codec {name!r}: fp32, fp16, bf16, int8[:stochastic][:chunk], topk:<ratio>"
                     "[+codec] or sign")  # fmt: skip


_CASTS = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def _int8(args: str, name: str) -> Int8:
    stochastic, chunk = False, INT8_CHUNK
    for part in args.split(":") if args else []:
        if part in ("nearest", "stochastic"):
            stochastic = part == "stochastic"
        elif part.isdigit() and int(part) > 0:
            chunk = int(part)
        else:
            raise ValueError(f"int8 takes nearest|stochastic and a chunk size, not {part!r} in {name!r}")
    return Int8(stochastic, chunk)


def resolve(codec: Codec | str | None) -> Codec | None:
    """A codec given by object or wire name; None (and ``"none"``) for no compression."""
    if codec is None or isinstance(codec, Codec):
        return codec
    return None if codec in ("", "none") else codec_for(codec)


def from_wire(name: str | None) -> Codec | None:
    """The codec a frame names (None: raw data); ProtocolError for a name this side does not know."""
    if name is None:
        return None
    try:
        return codec_for(name)
    except ValueError as exc:
        raise ProtocolError(f"a frame names an unknown codec: {exc}") from None


def decode_all(codec: Codec, payloads: Sequence[torch.Tensor], outs: Sequence[torch.Tensor]) -> None:
    """Decode each payload into its tensor (a push's gradients, a pull's parameters)."""
    for payload, out in zip(payloads, outs, strict=True):
        codec.decode(payload, out)


def payload_total(codec: Codec, numels: Iterable[int]) -> int:
    return sum(codec.payload_bytes(n) for n in numels)
