"""The delta encode/decode kernels (nereus.backends.triton.delta) against the torch code of
nereus.runtime.delta_codec, under the interpreter: the same code chunk by chunk (on a GPU
the kernel places chunks in the payload in the order they finish, torch in chunk order:
the directory says where each is), decoding either side's code gives the message, and the
checksums agree."""

import pytest
import torch

from nereus.backends.triton import delta as kernels
from nereus.passes.delta import HEADER_BYTES
from nereus.runtime import delta_codec


def _by_chunk(head: torch.Tensor, payload: torch.Tensor, word: int, chunk: int, n: int) -> list:
    """(k << 2 | format, the chunk's payload bytes) per chunk, in chunk order."""
    directory = head[HEADER_BYTES:].view(torch.int32).view(-1, 2).to(torch.int64)
    k = directory[:, 1] >> 2
    length = torch.full_like(k, chunk)
    length[-1] = n - (len(k) - 1) * chunk
    _, size = delta_codec.sizes(k, length, word)
    return [(int(code), payload[4 * int(at): 4 * int(at) + int(nbytes)].tolist())
            for (at, code), nbytes in zip(directory.tolist(), size.tolist())]


def _message(word: int, n: int, changed: float, seed: int):
    gen = torch.Generator().manual_seed(seed)
    old = torch.randint(-2 ** 15, 2 ** 15, (n,), generator=gen, dtype=torch.int32).to(delta_codec.WORDS[word])
    new = old.clone()
    where = torch.rand(n, generator=gen) < changed
    new[where] = new[where] + 1  # any change of the word's bits
    return old.view(torch.uint8).clone(), new.view(torch.uint8).clone()


# sparse-only, mixed, mask-heavy and dense-only messages; a last chunk that is short; an
# odd number of words (1353: the payload buffer's bytes are then no whole int32 words
# unless rounded up; an H100 run failed on it, the interpreter's views did too)
@pytest.mark.parametrize("word", [1, 2, 4])
@pytest.mark.parametrize("changed", [0.0, 0.004, 0.05, 0.6, 1.0])
@pytest.mark.parametrize("n", [256 * 5 + 72, 256 * 5 + 73])
def test_kernels_write_the_torch_code_and_decode_it(word, changed, n):
    chunk = 256
    old, new = _message(word, n, changed, seed=word * 100 + int(changed * 1000))
    ref_t, ref_k = old.clone(), old.clone()
    head_t, payload_t = delta_codec.encode(new, ref_t, word, chunk)
    head_k, payload_k = kernels.encode(new, ref_k, word, chunk)
    total = delta_codec.header_of(head_t)[0]
    assert torch.equal(head_k[:HEADER_BYTES], head_t[:HEADER_BYTES])  # payload bytes, checksums, flags
    assert _by_chunk(head_k, payload_k, word, chunk, n) == _by_chunk(head_t, payload_t, word, chunk, n)
    assert torch.equal(ref_k, new) and torch.equal(ref_t, new)
    for decoder in (delta_codec.decode, kernels.decode):
        dst = old.clone()
        sums = decoder(dst, head_k, payload_k[:total], word, chunk)
        assert torch.equal(dst, new)
        assert sums == delta_codec.header_of(head_t)[1:3] == delta_codec.checksums(new.view(delta_codec.WORDS[word]))


def test_a_payload_at_an_odd_offset_decodes():
    """A payload sliced out of a larger receive buffer at an offset no int32 view takes."""
    old, new = _message(2, 1001, 0.05, seed=3)
    head, payload = delta_codec.encode(new, old.clone(), 2, 256)
    total = delta_codec.header_of(head)[0]
    buffer = torch.zeros(total + 1, dtype=torch.uint8)
    buffer[1:].copy_(payload[:total])
    dst = old.clone()
    kernels.decode(dst, head, buffer[1:], 2, 256)
    assert torch.equal(dst, new)


def test_a_missing_changed_word_changes_the_weighted_checksum():
    """What the receiver's check rests on: one changed word left out of the code leaves a
    result whose checksums differ from the sender's."""
    old, new = _message(2, 4096, 0.01, seed=7)
    head, payload = delta_codec.encode(new, old.clone(), 2, 1024)
    total, sent, weighted, _ = delta_codec.header_of(head)
    directory = head[delta_codec.HEADER_BYTES:].view(torch.int32).view(-1, 2)
    chunk = int(torch.nonzero(directory[:, 1] & 3 == delta_codec.SPARSE)[0])
    directory[chunk, 1] -= 4  # one index fewer in a sparse chunk: its last changed word is not applied
    dst = old.clone()
    assert kernels.decode(dst, head, payload[:total], 2, 1024) != (sent, weighted)
