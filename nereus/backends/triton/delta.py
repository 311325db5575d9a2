"""Delta encode and decode of a weight-sync message: one Triton launch each.

The code (header, per-chunk directory, per-chunk payload in the smallest of sparse /
bitmask / dense form) is specified in nereus.runtime.delta_codec, whose torch functions
are the CPU path and the reference these kernels are tested against (tests/triton,
TRITON_INTERPRET=1 on CPU).

A program codes G whole chunks of CHUNK words as one [G, CHUNK] tile (TILE words).
Per chunk, encode: load the chunk of the current message and of the reference, count
the changed words, pick the form from the counts, take its place in the payload (one
atomic add on a cursor per tile, so the payload is written in one pass, tiles in the
order they finish: the directory says where each chunk is), write it, write the
changed words into the reference, and the chunk's two checksums. decode: read the
chunk's directory entry, write the changed words into the receiver's bytes (sparse: a
scatter of k words; mask and dense: the chunk merged) and the checksums of the result
(sparse: the old words' contribution taken out, the new ones' put in, so the chunk is
read once). Traffic per message of n words of w bytes: encode reads 2nw and writes the
payload and the changed words; decode reads nw (mask, dense) or only the k changed
positions plus the chunk (sparse) and writes the changed words.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from nereus.passes.delta import DIRECTORY_BYTES, HEADER_BYTES, chunks

from .kernels import _LAUNCH_TURNS

WORDS = {1: torch.int8, 2: torch.int16, 4: torch.int32}
MODULUS = 65521
TILE = 16384  # words a program codes (whole chunks): the H100 sweep in benchmarks/RESULTS.md
NUM_WARPS = 8


@triton.jit
def _pad4(x):
    return (x + 3) // 4 * 4


@triton.jit
def _weights(start, lanes, MODULUS: tl.constexpr):
    """(start + lane) mod MODULUS + 1, without a 64-bit division per element: a chunk
    (at most 65536 words) wraps at most once."""
    w = (start % MODULUS).to(tl.int32) + lanes
    return tl.where(w >= MODULUS, w - MODULUS, w) + 1


@triton.jit
def _sums(x, start, lanes, W: tl.constexpr, MODULUS: tl.constexpr):
    """(sum, weighted sum) of each row (chunk) of a [G, C] tile of words, int64. Words of
    at most 2 bytes times a weight below 2^16 fit int32 exactly (|x| <= 2^15,
    2^15 * 65521 < 2^31), so only 4-byte words pay for 64-bit products."""
    weight = _weights(start, lanes, MODULUS)
    if W <= 2:
        xi = x.to(tl.int32)
        return tl.sum(xi.to(tl.int64), axis=1), tl.sum((xi * weight).to(tl.int64), axis=1)
    else:
        xs = x.to(tl.int64)
        return tl.sum(xs, axis=1), tl.sum(xs * weight, axis=1)


@triton.jit
def encode_kernel(cur, ref, payload16, payload32, payloadw, directory, sums, cursor, n, count,
                  C: tl.constexpr, W: tl.constexpr, MODULUS: tl.constexpr, G: tl.constexpr):
    """Program p codes chunks pG .. pG + G - 1 as one [G, C] tile: one load, one set of
    reductions and one cursor atomic for G chunks (a chunk per program spent most of its
    time waiting on those, one after the other)."""
    c = tl.program_id(0).to(tl.int64) * G + tl.arange(0, G)
    valid = c < count
    lanes = tl.arange(0, C)[None, :]
    start = (c * C)[:, None]
    offs = start + lanes
    inside = offs < n
    x = tl.load(cur + offs, mask=inside, other=0)
    r = tl.load(ref + offs, mask=inside, other=0)
    changed = (x != r) & inside
    flag = changed.to(tl.int32)
    k = tl.sum(flag, axis=1)
    length = tl.where(valid, tl.minimum(n - c * C, C), 0).to(tl.int32)
    total, weighted = _sums(x, start, lanes, W, MODULUS)
    tl.store(sums + 2 * c, total, mask=valid)
    tl.store(sums + 2 * c + 1, weighted, mask=valid)
    words32 = (length + 31) // 32
    sparse = _pad4(2 * k) + _pad4(W * k)
    masked = 4 * words32 + _pad4(W * k)
    dense = _pad4(W * length)
    fmt = tl.where(sparse <= masked, tl.where(sparse <= dense, 1, 3), tl.where(masked <= dense, 2, 3))
    size = tl.where(sparse <= masked, tl.where(sparse <= dense, sparse, dense), tl.where(masked <= dense, masked, dense))
    fmt = tl.where(k > 0, fmt, 0)
    units = tl.where(k > 0, size, 0) // 4  # the chunk's payload in 4-byte units
    # the tile's place in the payload (one atomic), its chunks in order within it
    first = tl.atomic_add(cursor, tl.sum(units, axis=0))
    at = first + tl.cumsum(units, axis=0) - units
    tl.store(directory + 2 * c, at, mask=valid)
    tl.store(directory + 2 * c + 1, k * 4 + fmt, mask=valid)
    base = at.to(tl.int64) * 4
    pad = tl.arange(0, 4)[None, :]  # the padding to 4 bytes is written as zeros: the code is deterministic
    kk = k[:, None]
    is_sparse = (fmt == 1)[:, None]
    is_mask = (fmt == 2)[:, None]
    is_dense = (fmt == 3)[:, None]
    rank = tl.cumsum(flag, axis=1) - 1
    # sparse: k uint16 indices, then the k changed words
    tl.store(payload16 + (base // 2)[:, None] + rank, lanes.to(tl.int16), mask=changed & is_sparse)
    tl.store(payload16 + (base // 2)[:, None] + kk + pad, tl.zeros((G, 4), tl.int16),
             mask=is_sparse & (pad < ((_pad4(2 * k) - 2 * k) // 2)[:, None]))
    # mask: the chunk's bits in int32 words, then the k changed words
    bits = tl.reshape(flag, (G, C // 32, 32)) << tl.arange(0, 32)[None, None, :]
    packed = tl.sum(bits, axis=2)
    q = tl.arange(0, C // 32)[None, :]
    tl.store(payload32 + (base // 4)[:, None] + q, packed, mask=is_mask & (q < words32[:, None]))
    # the changed words of both (after the indices or the bits)
    values = tl.where(fmt == 1, (base + _pad4(2 * k)) // W, (base + 4 * words32) // W)[:, None]
    keep = is_sparse | is_mask
    tl.store(payloadw + values + rank, x, mask=changed & keep)
    tl.store(payloadw + values + kk + pad, tl.zeros((G, 4), x.dtype),
             mask=keep & (pad < ((_pad4(W * k) - W * k) // W)[:, None]))
    # dense: the chunk's words
    tl.store(payloadw + (base // W)[:, None] + lanes, x, mask=is_dense & inside)
    tl.store(payloadw + (base // W + length)[:, None] + pad, tl.zeros((G, 4), x.dtype),
             mask=is_dense & (pad < ((_pad4(W * length) - W * length) // W)[:, None]))
    tl.store(ref + offs, x, mask=changed)


@triton.jit
def decode_kernel(dst, payload16, payload32, payloadw, directory, sums, n, count,
                  C: tl.constexpr, W: tl.constexpr, MODULUS: tl.constexpr, G: tl.constexpr):
    """Program p applies chunks pG .. pG + G - 1 as one [G, C] tile (see encode_kernel)."""
    c = tl.program_id(0).to(tl.int64) * G + tl.arange(0, G)
    valid = c < count
    lanes = tl.arange(0, C)[None, :]
    start = (c * C)[:, None]
    offs = start + lanes
    inside = offs < n
    at = tl.load(directory + 2 * c, mask=valid, other=0).to(tl.int64)
    code = tl.load(directory + 2 * c + 1, mask=valid, other=0)
    k = code >> 2
    fmt = code & 3
    base = at * 4
    x = tl.load(dst + offs, mask=inside, other=0)
    weight = _weights(start, lanes, MODULUS)
    total, weighted = _sums(x, start, lanes, W, MODULUS)
    # sparse: a scatter of the k changed words
    sp = (fmt == 1)[:, None] & (lanes < k[:, None])
    index = tl.load(payload16 + (base // 2)[:, None] + lanes, mask=sp, other=0).to(tl.int32) & 0xFFFF
    values = tl.load(payloadw + ((base + _pad4(2 * k)) // W)[:, None] + lanes, mask=sp, other=0)
    where = start + index
    before = tl.load(dst + where, mask=sp, other=0).to(tl.int64)
    tl.store(dst + where, values, mask=sp)
    change = tl.where(sp, values.to(tl.int64) - before, 0)
    total += tl.sum(change, axis=1)
    weighted += tl.sum(change * _weights(start, index, MODULUS), axis=1)
    # mask and dense: the chunk merged
    words32 = (tl.minimum(n - c * C, C).to(tl.int32) + 31) // 32
    mk = (fmt == 2)[:, None] & inside
    packed = tl.load(payload32 + (base // 4)[:, None] + lanes // 32, mask=mk, other=0)
    flag = (((packed >> (lanes % 32)) & 1) != 0) & mk
    rank = tl.cumsum(flag.to(tl.int32), axis=1) - 1
    dn = (fmt == 3)[:, None] & inside
    at_word = tl.where(fmt == 2, (base + 4 * words32) // W, base // W)[:, None] + tl.where(mk, rank, lanes)
    merged = flag | dn
    values = tl.load(payloadw + at_word, mask=merged, other=0)
    tl.store(dst + offs, values, mask=merged)
    change = tl.where(merged, values.to(tl.int64) - x.to(tl.int64), 0)
    total += tl.sum(change, axis=1)
    weighted += tl.sum(change * weight, axis=1)
    tl.store(sums + 2 * c, total, mask=valid)
    tl.store(sums + 2 * c + 1, weighted, mask=valid)


def rows(chunk: int, tile: int = TILE) -> int:
    """Chunks per program: `tile` words a program, at least one chunk."""
    return max(1, tile // chunk)


def _views(payload: torch.Tensor, word: int) -> tuple:
    """The payload as int16, int32 and word views (the kernels address it in all three)."""
    if payload.numel() % 4 or payload.storage_offset() % 4:
        # a byte length or offset no int32 view takes (a CPU encoder's exact payload, a slice
        # of a receive buffer): a zero-padded aligned copy, read-only for the decoder
        padded = torch.zeros(-(-payload.numel() // 4) * 4, dtype=torch.uint8, device=payload.device)
        padded[:payload.numel()].copy_(payload)
        payload = padded
    if payload.numel() == 0:  # a kernel still needs valid pointers
        payload = torch.zeros(4, dtype=torch.uint8, device=payload.device)
    return payload.view(torch.int16), payload.view(torch.int32), payload.view(WORDS[word])


def encode(cur: torch.Tensor, ref: torch.Tensor, word: int, chunk: int, flags: int = 0, *,
           tile: int = TILE, num_warps: int = NUM_WARPS):
    """delta_codec.encode on CUDA (or under TRITON_INTERPRET=1): (head, payload).
    `tile`, `num_warps`: the launch (benchmarks sweep them; the defaults are measured)."""
    x, r = cur.view(WORDS[word]), ref.view(WORDS[word])
    n = x.numel()
    count = chunks(n * word, chunk, word)
    device = cur.device
    head = torch.zeros(HEADER_BYTES + DIRECTORY_BYTES * count, dtype=torch.uint8, device=device)
    directory = head[HEADER_BYTES:].view(torch.int32)
    # the payload never exceeds the message plus 4 bytes of padding per chunk
    # (rounded up to whole int32 words: the kernel writes through an int32 view of it)
    payload = torch.empty(-(-(n * word + 4 * count + 4) // 4) * 4, dtype=torch.uint8, device=device)
    sums = torch.empty(2 * max(count, 1), dtype=torch.int64, device=device)
    cursor = torch.zeros(1, dtype=torch.int32, device=device)
    if count:
        p16, p32, pw = _views(payload, word)
        with _LAUNCH_TURNS:
            g = rows(chunk, tile)
            encode_kernel[(-(-count // g),)](x, r, p16, p32, pw, directory, sums, cursor, n, count, C=chunk, W=word,
                                             MODULUS=MODULUS, G=g, num_warps=num_warps)
    header = head[:HEADER_BYTES].view(torch.int64)
    header[0] = cursor[0].to(torch.int64) * 4
    header[1:3] = sums.view(-1, 2)[:count].sum(dim=0) if count else 0
    header[3] = flags
    return head, payload


def decode(dst: torch.Tensor, head: torch.Tensor, payload: torch.Tensor, word: int, chunk: int, *,
           tile: int = TILE, num_warps: int = NUM_WARPS):
    """delta_codec.decode on CUDA (or under TRITON_INTERPRET=1): the result's checksums."""
    x = dst.view(WORDS[word])
    n = x.numel()
    count = chunks(n * word, chunk, word)
    if not count:
        return 0, 0
    sums = torch.empty(2 * count, dtype=torch.int64, device=dst.device)
    p16, p32, pw = _views(payload, word)
    with _LAUNCH_TURNS:
        g = rows(chunk, tile)
        decode_kernel[(-(-count // g),)](x, p16, p32, pw, head[HEADER_BYTES:].view(torch.int32), sums, n, count,
                                         C=chunk, W=word, MODULUS=MODULUS, G=g, num_warps=num_warps)
    total = sums.view(-1, 2).sum(dim=0).tolist()
    return total[0], total[1]
