"""delta: a weight sync's JSON program → the same sync sending only what changed.

Input: a whole JSON program v1 of a weight sync (dense, or quantized by
nereus.passes.quantize) and the delta chunk (elements of the message's word per chunk).
Output: a new program (docs/program.md, "Weight-sync codecs") with header field
`delta` = {"chunk": C} and `"encoding": "delta"` on every send: run after a run of the
same program, each message carries only the words that differ from what its sender sent
the last time (per chunk of C words: changed indices and values, a bitmask and values,
or the chunk whole, whichever is smallest), and the receiver applies them in place to the
shards that run wrote. A send's `bytes` stay the dense count: the most it can move.
Invariant: the ops, segments and rounds are the dense program's, so the verifier's proof
that every after box is written exactly once holds for a delta run as for a full one
(what a delta run adds — which words changed — is checked at run time, by a checksum of
every message's full region; verify_codec.py says what is proven where).
"""

from __future__ import annotations

import copy

from nereus.ir.diagnostics import ProgramError

CHUNK = 4096  # words per chunk: uint16 indices, a 512-byte mask; 8 bytes of directory each
CHUNK_RANGE = (64, 65536)  # a power of two in this range: the indices are uint16, the mask whole int32 words
HEADER_BYTES = 32  # int64 [payload bytes, checksum, weighted checksum, flags]
DIRECTORY_BYTES = 8  # per chunk: int32 [payload offset / 4, changed words << 2 | format]


def chunks(nbytes: int, chunk: int, word: int = 1) -> int:
    """Chunks of a message of `nbytes` bytes in words of `word` bytes."""
    return -(-(nbytes // word) // chunk)


def encoded_bound(nbytes: int, chunk: int) -> int:
    """The most a delta-coded message of `nbytes` dense bytes takes (header, directory and
    payload, any word size): a chunk is never sent larger than whole, plus 3 bytes of
    padding to 4."""
    n = chunks(nbytes, chunk)
    return HEADER_BYTES + DIRECTORY_BYTES * n + nbytes + 3 * n


def check_chunk(chunk) -> int:
    if type(chunk) is not int or not CHUNK_RANGE[0] <= chunk <= CHUNK_RANGE[1] or chunk & (chunk - 1):
        raise ProgramError(f"delta chunk {chunk!r} is not a power of two in {CHUNK_RANGE[0]}..{CHUNK_RANGE[1]}",
                           hint=f"the default is {CHUNK} words")
    return chunk


def delta_program(program: dict, chunk: int = CHUNK) -> dict:
    """See the module docstring."""
    if program.get("version") != 1:
        raise ProgramError("delta reads programs of version 1", hint="emit the sync with program_json(compiled)")
    data = copy.deepcopy(program)
    for rnd in data["rounds"]:
        for op in rnd["ops"]:
            if op["op"] == "send":
                op["encoding"] = "delta"
    data["delta"] = {"chunk": check_chunk(chunk)}
    return data
