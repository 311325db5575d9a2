"""The delta code of one message: what changed since the sender's last send, and its
application on the receiver (docs/program.md, "Weight-sync codecs").

A message is its packed bytes (the pack layout), read as `n` words of `word` bytes (the
narrowest element of its pieces, at most 4: changed means bitwise different). Its words
are cut into chunks of C words; per chunk the encoder writes whichever of these is
smallest (ties in this order):
  1 sparse: k uint16 indices in the chunk, then the k changed words;
  2 mask:   a bitmask of the chunk (int32 words, bit b of word q = word 32q + b), then the
            k changed words in order;
  3 dense:  the chunk's words;
  0 none:   nothing (k = 0);
each part padded to 4 bytes. The coded message is a header, int64 [payload bytes,
checksum, weighted checksum, flags], a directory, int32 [offset / 4, k << 2 | format] per
chunk (both of a size fixed by the message: HEADER_BYTES + DIRECTORY_BYTES per chunk),
and the payload of every chunk's part (order: the directory's offsets). The checksums
are the wrapping int64 sums of the message's words x_i and of x_i * (i mod 65521 + 1):
the sender's over its full current message; the receiver, after applying the delta to
the bytes it holds (its last result of the same program, packed), computes them over the
result and must find the same (a single wrong or missing word always changes the
weighted sum: its weight is nonzero and below 2^16 and the word's change below 2^32 in
size, so the sum moves by a nonzero amount below 2^48, never a multiple of 2^64).

`encode(cur, ref, word, chunk)` returns (header+directory, payload) and updates `ref` to
`cur`; `decode(dst, coded, payload, word, chunk)` applies in place and returns the
checksums of the result. On CUDA tensors both are one Triton launch per message
(nereus.backends.triton.delta; the payload's chunk order then follows the order in which
chunks finish, the directory says where each is); elsewhere plain torch, in chunk order.
"""

from __future__ import annotations

from typing import Optional

import torch

from nereus.passes.delta import CHUNK, DIRECTORY_BYTES, HEADER_BYTES, chunks

WORDS = {1: torch.int8, 2: torch.int16, 4: torch.int32}
NONE, SPARSE, MASK, DENSE = 0, 1, 2, 3
FAILED = 1  # header flag: the sender could not build the message (the receiver must not apply it)
MODULUS = 65521


def coded_bytes(nbytes: int, word: int, chunk: int = CHUNK) -> int:
    """Bytes of the header and directory of a message of `nbytes` bytes."""
    return HEADER_BYTES + DIRECTORY_BYTES * chunks(nbytes, chunk, word)


def _pad4(x: torch.Tensor) -> torch.Tensor:
    return (x + 3) // 4 * 4


def _words(buffer: torch.Tensor, word: int) -> torch.Tensor:
    return buffer.view(torch.uint8).view(WORDS[word])


def weights(n: int, device) -> torch.Tensor:
    return torch.arange(n, dtype=torch.int64, device=device) % MODULUS + 1


def checksums(words: torch.Tensor) -> tuple[int, int]:
    """(sum, weighted sum) of a message's words, wrapping int64 (both sides compute alike)."""
    x = words.to(torch.int64)
    return int(x.sum()), int((x * weights(x.numel(), x.device)).sum())


def sizes(k: torch.Tensor, length: torch.Tensor, word: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(format, payload bytes) per chunk of k changed words out of `length`."""
    sparse = _pad4(2 * k) + _pad4(word * k)
    mask = 4 * ((length + 31) // 32) + _pad4(word * k)
    dense = _pad4(word * length)
    options = torch.stack([sparse, mask, dense])
    best = options.argmin(dim=0)  # first minimum: sparse, then mask, then dense
    fmt = torch.where(k > 0, best + 1, torch.zeros_like(best))
    size = torch.where(k > 0, options.gather(0, best.unsqueeze(0)).squeeze(0), torch.zeros_like(k))
    return fmt, size


def encode(cur: torch.Tensor, ref: torch.Tensor, word: int, chunk: int = CHUNK,
           flags: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Input: the message's current bytes and the bytes last sent (uint8, same length, a
    multiple of `word`). Output: (header + directory, payload), both uint8; `ref` then
    holds `cur`. CUDA: the Triton kernel (payload in completion order); else torch."""
    if cur.is_cuda:
        from nereus.backends.triton.delta import encode as kernel

        return kernel(cur, ref, word, chunk, flags)
    x, r = _words(cur, word), _words(ref, word)
    n = x.numel()
    count = chunks(n * word, chunk, word)
    head = torch.zeros(HEADER_BYTES + DIRECTORY_BYTES * count, dtype=torch.uint8)
    header, directory = head[:HEADER_BYTES].view(torch.int64), head[HEADER_BYTES:].view(torch.int32).view(count, 2)
    changed = torch.zeros(count * chunk, dtype=torch.bool)
    changed[:n] = x != r
    grid = changed.view(count, chunk)
    k = grid.sum(dim=1)
    length = torch.full((count,), chunk, dtype=torch.int64)
    if count:
        length[-1] = n - (count - 1) * chunk
    fmt, size = sizes(k, length, word)
    offset = torch.cumsum(size, 0) - size
    total = int(size.sum())
    payload = torch.zeros(total, dtype=torch.uint8)
    directory[:, 0] = (offset // 4).to(torch.int32)
    directory[:, 1] = (k * 4 + fmt).to(torch.int32)
    positions = torch.nonzero(changed).squeeze(1)
    owner = positions // chunk
    rank = torch.arange(positions.numel()) - (torch.cumsum(k, 0) - k)[owner]
    values = x[positions]
    sparse, mask = fmt[owner] == SPARSE, fmt[owner] == MASK
    if total:
        as16, asw = payload.view(torch.int16), payload.view(WORDS[word])
        base = offset[owner]
        at = base[sparse] // 2 + rank[sparse]
        as16[at] = (positions[sparse] % chunk).to(torch.int32).to(torch.int16)
        value_at = torch.where(sparse, base + _pad4(2 * k[owner]), base + 4 * ((length[owner] + 31) // 32))
        keep = sparse | mask
        asw[value_at[keep] // word + rank[keep]] = values[keep]
        masked = torch.nonzero(fmt == MASK).squeeze(1)
        if masked.numel():
            bits = grid[masked].view(-1, chunk // 32, 32).to(torch.int64) << torch.arange(32)
            packed = bits.sum(dim=2)
            packed = torch.where(packed >= 2 ** 31, packed - 2 ** 32, packed).to(torch.int32)
            for row, c in zip(packed, masked.tolist()):
                words32 = (int(length[c]) + 31) // 32
                start = int(offset[c]) // 4
                payload.view(torch.int32)[start:start + words32] = row[:words32]
        dense = torch.nonzero(fmt == DENSE).squeeze(1)
        for c in dense.tolist():
            start, span = int(offset[c]) // word, int(length[c])
            asw[start:start + span] = x[c * chunk: c * chunk + span]
    total_sum, weighted = checksums(x)
    header.copy_(torch.tensor([total, total_sum, weighted, flags], dtype=torch.int64))
    r.copy_(x)
    return head, payload


def header_of(head: torch.Tensor) -> tuple[int, int, int, int]:
    """(payload bytes, checksum, weighted checksum, flags) of a coded message's head."""
    values = head[:HEADER_BYTES].view(torch.int64).tolist()
    return values[0], values[1], values[2], values[3]


def decode(dst: torch.Tensor, head: torch.Tensor, payload: torch.Tensor, word: int,
           chunk: int = CHUNK) -> tuple[int, int]:
    """Apply a coded message to `dst` (uint8, the message's bytes as the receiver holds
    them) in place; returns the checksums of the result. CUDA: the Triton kernel."""
    if dst.is_cuda:
        from nereus.backends.triton.delta import decode as kernel

        return kernel(dst, head, payload, word, chunk)
    x = _words(dst, word)
    n = x.numel()
    count = chunks(n * word, chunk, word)
    directory = head[HEADER_BYTES:].view(torch.int32).view(count, 2).to(torch.int64)
    offset, k, fmt = directory[:, 0] * 4, directory[:, 1] >> 2, directory[:, 1] & 3
    length = torch.full((count,), chunk, dtype=torch.int64)
    if count:
        length[-1] = n - (count - 1) * chunk
    if payload.numel():
        as16, asw, as32 = payload.view(torch.int16), payload.view(WORDS[word]), payload.view(torch.int32)
        for c in torch.nonzero(fmt == SPARSE).squeeze(1).tolist():
            kc, base = int(k[c]), int(offset[c])
            idx = as16[base // 2: base // 2 + kc].to(torch.int64) & 0xFFFF
            start = (base + (2 * kc + 3) // 4 * 4) // word
            x[c * chunk + idx] = asw[start:start + kc]
        for c in torch.nonzero(fmt == MASK).squeeze(1).tolist():
            kc, base, span = int(k[c]), int(offset[c]), int(length[c])
            words32 = (span + 31) // 32
            packed = as32[base // 4: base // 4 + words32].to(torch.int64)
            bits = ((packed.unsqueeze(1) >> torch.arange(32)) & 1).reshape(-1)[:span].bool()
            start = (base + 4 * words32) // word
            x[c * chunk: c * chunk + span][bits] = asw[start:start + kc]
        for c in torch.nonzero(fmt == DENSE).squeeze(1).tolist():
            start, span = int(offset[c]) // word, int(length[c])
            x[c * chunk: c * chunk + span] = asw[start:start + span]
    return checksums(x)


def word_of(element_sizes) -> int:
    """The word a message is compared in: the narrowest element of its pieces, at most 4."""
    sizes_ = set(element_sizes) or {4}
    return min(4, min(sizes_))


def reference(nbytes: int, device, like: Optional[torch.Tensor] = None) -> torch.Tensor:
    """A new reference buffer (the sender's copy of its last message)."""
    return torch.zeros(nbytes, dtype=torch.uint8, device=device) if like is None else like.clone()
