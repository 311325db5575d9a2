"""Delta encode and decode of a weight-sync message: one Triton launch each.

The code (header, per-chunk directory, per-chunk payload in the smallest of sparse /
bitmask / dense form) is specified in nereus.runtime.delta_codec, whose torch functions
are the CPU path and the reference these kernels are tested against (tests/triton,
TRITON_INTERPRET=1 on CPU).

Persistent programs (a few per multiprocessor) each walk chunks of CHUNK words, loading
the next chunk while coding the current one. Per chunk, encode: load the chunk of the current message and
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
PROGRAMS_PER_SM = 4  # resident programs per multiprocessor (the H100 sweep in benchmarks/RESULTS.md)
NUM_WARPS = 4


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
    """(sum, weighted sum) of a chunk's words, int64. Words of at most 2 bytes times a
    weight below 2^16 fit int32 exactly (|x| <= 2^15, 2^15 * 65521 < 2^31), so only the
    4-byte words pay for 64-bit products."""
    weight = _weights(start, lanes, MODULUS)
    if W <= 2:
        xi = x.to(tl.int32)
        return tl.sum(xi.to(tl.int64), axis=0), tl.sum((xi * weight).to(tl.int64), axis=0)
    else:
        xs = x.to(tl.int64)
        return tl.sum(xs, axis=0), tl.sum(xs * weight, axis=0)


@triton.jit
def _encode_chunk(x, r, c, ref, payload16, payload32, payloadw, directory, sums, cursor, n,
                  C: tl.constexpr, W: tl.constexpr, MODULUS: tl.constexpr):
    start = c * C
    lanes = tl.arange(0, C)
    offs = start + lanes
    inside = offs < n
    changed = (x != r) & inside
    flag = changed.to(tl.int32)
    k = tl.sum(flag, axis=0)
    length = tl.minimum(n - start, C).to(tl.int32)
    total, weighted = _sums(x, start, lanes, W, MODULUS)
    tl.store(sums + 2 * c, total)
    tl.store(sums + 2 * c + 1, weighted)
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
    pad = tl.arange(0, 4)  # the padding to 4 bytes is written as zeros: the code is deterministic
    if fmt == 1:
        rank = tl.cumsum(flag, axis=0) - 1
        tl.store(payload16 + base // 2 + rank, lanes.to(tl.int16), mask=changed)
        tl.store(payload16 + base // 2 + k + pad, tl.zeros((4,), tl.int16), mask=pad < (_pad4(2 * k) - 2 * k) // 2)
        values = (base + _pad4(2 * k)) // W
        tl.store(payloadw + values + rank, x, mask=changed)
        tl.store(payloadw + values + k + pad, tl.zeros((4,), x.dtype), mask=pad < (_pad4(W * k) - W * k) // W)
    if fmt == 2:
        rank = tl.cumsum(flag, axis=0) - 1
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
    if k > 0:
        tl.store(ref + offs, x, mask=changed)


@triton.jit
def encode_kernel(cur, ref, payload16, payload32, payloadw, directory, sums, cursor, n, count,
                  C: tl.constexpr, W: tl.constexpr, MODULUS: tl.constexpr):
    """Persistent: program p codes chunks p, p + P, p + 2P, ...; the next chunk's loads are
    issued before the current one is coded, so they overlap its reductions and the round
    trip of its cursor atomic (one chunk per program left HBM idle meanwhile)."""
    step = tl.num_programs(0)
    lanes = tl.arange(0, C)
    c = tl.program_id(0).to(tl.int64)
    offs = c * C + lanes
    x_next = tl.load(cur + offs, mask=offs < n, other=0)
    r_next = tl.load(ref + offs, mask=offs < n, other=0)
    while c < count:
        x = x_next
        r = r_next
        ahead = (c + step) * C + lanes
        x_next = tl.load(cur + ahead, mask=ahead < n, other=0)
        r_next = tl.load(ref + ahead, mask=ahead < n, other=0)
        _encode_chunk(x, r, c, ref, payload16, payload32, payloadw, directory, sums, cursor, n, C, W, MODULUS)
        c += step


@triton.jit
def _decode_chunk(x, at, code, c, dst, payload16, payload32, payloadw, sums, n,
                  C: tl.constexpr, W: tl.constexpr, MODULUS: tl.constexpr):
    start = c * C
    lanes = tl.arange(0, C)
    offs = start + lanes
    inside = offs < n
    k = code >> 2
    fmt = code & 3
    base = at.to(tl.int64) * 4
    weight = _weights(start, lanes, MODULUS)
    total, weighted = _sums(x, start, lanes, W, MODULUS)
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


@triton.jit
def decode_kernel(dst, payload16, payload32, payloadw, directory, sums, n, count,
                  C: tl.constexpr, W: tl.constexpr, MODULUS: tl.constexpr):
    """Persistent as encode_kernel: the next chunk's words and directory entry are loaded
    before the current chunk is applied."""
    step = tl.num_programs(0)
    lanes = tl.arange(0, C)
    c = tl.program_id(0).to(tl.int64)
    offs = c * C + lanes
    x_next = tl.load(dst + offs, mask=offs < n, other=0)
    at_next = tl.load(directory + 2 * c, mask=c < count, other=0)
    code_next = tl.load(directory + 2 * c + 1, mask=c < count, other=0)
    while c < count:
        x = x_next
        at = at_next
        code = code_next
        ahead = c + step
        offs = ahead * C + lanes
        x_next = tl.load(dst + offs, mask=offs < n, other=0)
        at_next = tl.load(directory + 2 * ahead, mask=ahead < count, other=0)
        code_next = tl.load(directory + 2 * ahead + 1, mask=ahead < count, other=0)
        _decode_chunk(x, at, code, c, dst, payload16, payload32, payloadw, sums, n, C, W, MODULUS)
        c = ahead


def programs(count: int, device, per_sm: int = PROGRAMS_PER_SM) -> int:
    """The persistent grid: `per_sm` programs per multiprocessor, at most one per chunk
    (under the interpreter 3, so that its tests walk the loop)."""
    if device.type != "cuda":
        return max(1, min(count, 3))
    return max(1, min(count, per_sm * torch.cuda.get_device_properties(device).multi_processor_count))


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
           per_sm: int = PROGRAMS_PER_SM, num_warps: int = NUM_WARPS):
    """delta_codec.encode on CUDA (or under TRITON_INTERPRET=1): (head, payload).
    `per_sm`, `num_warps`: the launch (benchmarks sweep them; the defaults are measured)."""
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
            encode_kernel[(programs(count, device, per_sm),)](x, r, p16, p32, pw, directory, sums, cursor, n, count,
                                                              C=chunk, W=word, MODULUS=MODULUS, num_warps=num_warps)
    header = head[:HEADER_BYTES].view(torch.int64)
    header[0] = cursor[0].to(torch.int64) * 4
    header[1:3] = sums.view(-1, 2)[:count].sum(dim=0) if count else 0
    header[3] = flags
    return head, payload


def decode(dst: torch.Tensor, head: torch.Tensor, payload: torch.Tensor, word: int, chunk: int, *,
           per_sm: int = PROGRAMS_PER_SM, num_warps: int = NUM_WARPS):
    """delta_codec.decode on CUDA (or under TRITON_INTERPRET=1): the result's checksums."""
    x = dst.view(WORDS[word])
    n = x.numel()
    count = chunks(n * word, chunk, word)
    if not count:
        return 0, 0
    sums = torch.empty(2 * count, dtype=torch.int64, device=dst.device)
    p16, p32, pw = _views(payload, word)
    with _LAUNCH_TURNS:
        decode_kernel[(programs(count, dst.device, per_sm),)](x, p16, p32, pw, head[HEADER_BYTES:].view(torch.int32),
                                                              sums, n, count, C=chunk, W=word, MODULUS=MODULUS,
                                                              num_warps=num_warps)
    total = sums.view(-1, 2).sum(dim=0).tolist()
    return total[0], total[1]
