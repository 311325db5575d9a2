"""Delta encode and decode of a weight-sync message: one Triton launch each.

The code (header, per-chunk directory, per-chunk payload in the smallest of sparse /
bitmask / dense form) is specified in nereus.runtime.delta_codec, whose torch functions
are the CPU path and the reference these kernels are tested against (tests/triton,
TRITON_INTERPRET=1 on CPU).

One program per chunk of CHUNK words. encode: load the chunk of the current message and
of the reference, count the changed words, pick the form from the counts, take its place
in the payload with one atomic add on a cursor (so the payload is written in one pass,
chunks in the order they finish: the directory says where each is), write it, write the
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
def encode_kernel(cur, ref, payload16, payload32, payloadw, directory, sums, cursor, n,
                  C: tl.constexpr, W: tl.constexpr, MODULUS: tl.constexpr):
    c = tl.program_id(0).to(tl.int64)
    start = c * C
    lanes = tl.arange(0, C)
    offs = start + lanes
    inside = offs < n
    x = tl.load(cur + offs, mask=inside, other=0)
    r = tl.load(ref + offs, mask=inside, other=0)
    changed = (x != r) & inside
    flag = changed.to(tl.int32)
    k = tl.sum(flag, axis=0)
    length = tl.minimum(n - start, C).to(tl.int32)
    xs = x.to(tl.int64)
    tl.store(sums + 2 * c, tl.sum(xs, axis=0))
    tl.store(sums + 2 * c + 1, tl.sum(xs * _weights(start, lanes, MODULUS), axis=0))
    words32 = (length + 31) // 32
    sparse = _pad4(2 * k) + _pad4(W * k)
    masked = 4 * words32 + _pad4(W * k)
    dense = _pad4(W * length)
    fmt = tl.where(sparse <= masked, tl.where(sparse <= dense, 1, 3), tl.where(masked <= dense, 2, 3))
    size = tl.where(sparse <= masked, tl.where(sparse <= dense, sparse, dense), tl.where(masked <= dense, masked, dense))
    fmt = tl.where(k > 0, fmt, 0)
    size = tl.where(k > 0, size, 0)
    at = tl.atomic_add(cursor, size // 4)  # the chunk's place in the payload, in 4-byte units
    tl.store(directory + 2 * c, at)
    tl.store(directory + 2 * c + 1, k * 4 + fmt)
    base = at.to(tl.int64) * 4
    rank = tl.cumsum(flag, axis=0) - 1
    pad = tl.arange(0, 4)  # the padding to 4 bytes is written as zeros: the code is deterministic
    if fmt == 1:
        tl.store(payload16 + base // 2 + rank, lanes.to(tl.int16), mask=changed)
        tl.store(payload16 + base // 2 + k + pad, tl.zeros((4,), tl.int16), mask=pad < (_pad4(2 * k) - 2 * k) // 2)
        values = (base + _pad4(2 * k)) // W
        tl.store(payloadw + values + rank, x, mask=changed)
        tl.store(payloadw + values + k + pad, tl.zeros((4,), x.dtype), mask=pad < (_pad4(W * k) - W * k) // W)
    if fmt == 2:
        bits = tl.reshape(flag, (C // 32, 32)) << tl.arange(0, 32)[None, :]
        packed = tl.sum(bits, axis=1)
        q = tl.arange(0, C // 32)
        tl.store(payload32 + base // 4 + q, packed, mask=q < words32)
        values = (base + 4 * words32) // W
        tl.store(payloadw + values + rank, x, mask=changed)
        tl.store(payloadw + values + k + pad, tl.zeros((4,), x.dtype), mask=pad < (_pad4(W * k) - W * k) // W)
    if fmt == 3:
        tl.store(payloadw + base // W + lanes, x, mask=inside)
        tl.store(payloadw + base // W + length + pad, tl.zeros((4,), x.dtype),
                 mask=pad < (_pad4(W * length) - W * length) // W)
    tl.store(ref + offs, x, mask=changed)


@triton.jit
def decode_kernel(dst, payload16, payload32, payloadw, directory, sums, n,
                  C: tl.constexpr, W: tl.constexpr, MODULUS: tl.constexpr):
    c = tl.program_id(0).to(tl.int64)
    start = c * C
    lanes = tl.arange(0, C)
    offs = start + lanes
    inside = offs < n
    at = tl.load(directory + 2 * c).to(tl.int64)
    code = tl.load(directory + 2 * c + 1)
    k = code >> 2
    fmt = code & 3
    base = at * 4
    x = tl.load(dst + offs, mask=inside, other=0)
    weight = _weights(start, lanes, MODULUS)
    if W <= 2:
        # words of at most 2 bytes times a weight below 2^16 fit int32 exactly (|x| <= 2^15,
        # 2^15 * 65521 < 2^31): 64-bit products only for 4-byte words (H100, 1 GiB message:
        # 1.7x the decode's throughput)
        narrow = x.to(tl.int32)
        total = tl.sum(narrow.to(tl.int64), axis=0)
        weighted = tl.sum((narrow * weight).to(tl.int64), axis=0)
    else:
        old = x.to(tl.int64)
        total = tl.sum(old, axis=0)
        weighted = tl.sum(old * weight, axis=0)
    if fmt == 1:
        valid = lanes < k
        index = tl.load(payload16 + base // 2 + lanes, mask=valid, other=0).to(tl.int32) & 0xFFFF
        values = tl.load(payloadw + (base + _pad4(2 * k)) // W + lanes, mask=valid, other=0)
        where = start + index
        before = tl.load(dst + where, mask=valid, other=0).to(tl.int64)
        tl.store(dst + where, values, mask=valid)
        change = tl.where(valid, values.to(tl.int64) - before, 0)
        total += tl.sum(change, axis=0)
        weighted += tl.sum(change * _weights(start, index, MODULUS), axis=0)
    if fmt == 2:
        words32 = (tl.minimum(n - start, C).to(tl.int32) + 31) // 32
        packed = tl.load(payload32 + base // 4 + lanes // 32, mask=inside, other=0)
        flag = ((packed >> (lanes % 32)) & 1) != 0
        flag = flag & inside
        rank = tl.cumsum(flag.to(tl.int32), axis=0) - 1
        values = tl.load(payloadw + (base + 4 * words32) // W + rank, mask=flag, other=0)
        tl.store(dst + offs, values, mask=flag)
        change = tl.where(flag, values.to(tl.int64) - x.to(tl.int64), 0)
        total += tl.sum(change, axis=0)
        weighted += tl.sum(change * weight, axis=0)
    if fmt == 3:
        values = tl.load(payloadw + base // W + lanes, mask=inside, other=0)
        tl.store(dst + offs, values, mask=inside)
        change = tl.where(inside, values.to(tl.int64) - x.to(tl.int64), 0)
        total += tl.sum(change, axis=0)
        weighted += tl.sum(change * weight, axis=0)
    tl.store(sums + 2 * c, total)
    tl.store(sums + 2 * c + 1, weighted)


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


def encode(cur: torch.Tensor, ref: torch.Tensor, word: int, chunk: int, flags: int = 0):
    """delta_codec.encode on CUDA (or under TRITON_INTERPRET=1): (head, payload)."""
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
            encode_kernel[(count,)](x, r, p16, p32, pw, directory, sums, cursor, n, C=chunk, W=word, MODULUS=MODULUS,
                                    num_warps=8)
    header = head[:HEADER_BYTES].view(torch.int64)
    header[0] = cursor[0].to(torch.int64) * 4
    header[1:3] = sums.view(-1, 2)[:count].sum(dim=0) if count else 0
    header[3] = flags
    return head, payload


def decode(dst: torch.Tensor, head: torch.Tensor, payload: torch.Tensor, word: int, chunk: int):
    """delta_codec.decode on CUDA (or under TRITON_INTERPRET=1): the result's checksums."""
    x = dst.view(WORDS[word])
    n = x.numel()
    count = chunks(n * word, chunk, word)
    if not count:
        return 0, 0
    sums = torch.empty(2 * count, dtype=torch.int64, device=dst.device)
    p16, p32, pw = _views(payload, word)
    with _LAUNCH_TURNS:
        decode_kernel[(count,)](x, p16, p32, pw, head[HEADER_BYTES:].view(torch.int32), sums, n, C=chunk, W=word,
                                MODULUS=MODULUS, num_warps=8)
    total = sums.view(-1, 2).sum(dim=0).tolist()
    return total[0], total[1]
