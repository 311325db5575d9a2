"""One rank's work list of a weight-sync codec program (docs/program.md, "Weight-sync
codecs"), lowered from the whole program. Pure Python, no torch.

Input: a program with `delta` and/or `quant` (nereus.passes.delta / quantize) and this
rank. Output: a frozen `CodecWork`: the dense rank program it encodes
(program.rank_program of verify_codec.dense_of: the pieces of every copy and message,
cut and joined as for any transition, so both ends of a message list the same pieces),
and what the codecs add per piece and message: for a piece of a quantized tensor, where
it lands in the receiver's scale grid (`QuantPiece`: its origin, the blocks it holds
whole, those whose amax other pieces or GPUs share, the scales it carries and their
place in the receiver's scale tensor); per message its byte layout (pieces as packed,
quantized ones at 1 byte an element, then its scales), the word its delta compares in;
and the amax ops this rank sends (the source regions to reduce) and receives.
Invariant: sender and receiver derive the same layout for a message from the program
alone, so sizes always agree.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from nereus.ir.scale_blocks import boundary, grid, local_shape, origins
from nereus.models.quant import BLOCK
from nereus.passes.quantize import as_box, shard_index
from nereus.passes.verify_codec import dense_of

from .boxes import local_slices
from .packing import layout
from .pieces import single_tensor_pieces
from .program import ELEMENT_BYTES, Message, Piece, RankProgram, rank_program


@dataclass(frozen=True)
class QuantPiece:
    """How a piece of a quantized tensor is coded: it lands at local (row0, col0) of its
    receiving shard, meeting a ti x tj grid of blocks from block (i0, j0)."""

    shard: tuple  # (dst unit, receiving GPU, tensor)
    row0: int
    col0: int
    h: int
    w: int
    i0: int
    j0: int
    grid_cols: int  # of the receiving shard's scale tensor
    shared: tuple  # (a, b) relative blocks the piece does not hold whole: their amax comes from `given`
    carried: tuple  # (a, b) relative blocks whose origin the piece holds, row-major
    scale_index: tuple  # their flat indices in the receiving shard's scale tensor


@dataclass(frozen=True)
class CodedMessage:
    msg: Message
    quant: tuple  # per piece: QuantPiece or None
    offsets: tuple  # per piece, then the scales' offset
    nbytes: int  # the buffer: pieces and scales, 8-byte aligned
    scales: int  # scales it carries
    word: int  # bytes per word of its delta


@dataclass(frozen=True)
class CodecRound:
    copies: tuple  # (Piece, QuantPiece or None): same-GPU copies (and keeps of dense tensors)
    sends: tuple  # CodedMessage
    recvs: tuple


@dataclass(frozen=True)
class AmaxSend:
    peer: int
    parts: tuple  # per entry: ((src unit, tensor, local slices), ...): the max over them is sent


@dataclass(frozen=True)
class AmaxRecv:
    peer: int
    blocks: tuple  # per entry: (receiving shard, (i, j))


@dataclass(frozen=True)
class CodecWork:
    prog: RankProgram
    quantized: frozenset
    block: int
    chunk: Optional[int]  # None: no delta
    rounds: tuple
    amax_sends: tuple
    amax_recvs: tuple
    shared: dict  # receiving shard -> (rows, cols) of its scale grid, for the shards whose blocks this rank shares

    @property
    def reference_bytes(self) -> int:
        """What a delta sender keeps between runs: one copy of each message it sends."""
        return sum(m.nbytes for r in self.rounds for m in r.sends) if self.chunk else 0


def lower(program: dict, rank: int) -> CodecWork:
    """See the module docstring."""
    quant = program.get("quant")
    names = frozenset(quant["tensors"]) if quant else frozenset()
    block = quant["block"][0] if quant else BLOCK
    chunk = program["delta"]["chunk"] if "delta" in program else None
    prog = _one_tensor_each(rank_program(dense_of(program, (set(names), block) if quant else None, chunk), rank))
    after = shard_index(program["units"]["after"])
    before = shard_index(program["units"]["before"])
    tensors = {t["name"]: t for t in program["tensors"]}
    shared: dict = {}

    def coded(piece: Piece, dst_gpu: int) -> Optional[QuantPiece]:
        if piece.tensor not in names:
            return None
        if piece.parts != 1:
            raise ValueError(f"{piece.tensor}: a two-part piece cannot be quantized")
        key = (piece.dst_unit, dst_gpu, piece.tensor)
        shape = local_shape(after[key])
        rows, cols = piece.dst_slices
        rect = (rows.start, rows.stop, cols.start, cols.stop)
        i0, j0 = rows.start // block, cols.start // block
        part = tuple((i - i0, j - j0) for i, j in boundary(rect, shape, block))
        if part:
            shared[key] = grid(shape, block)
        oi0, oi1, oj0, oj1 = origins(rect, block)
        gc = grid(shape, block)[1]
        carried = tuple((i - i0, j - j0) for i in range(oi0, oi1) for j in range(oj0, oj1))
        return QuantPiece(key, rows.start, cols.start, rows.stop - rows.start, cols.stop - cols.start, i0, j0, gc,
                          part, carried, tuple((i0 + a) * gc + j0 + b for a, b in carried))

    def message(msg: Message, dst_gpu: int) -> CodedMessage:
        quants = tuple(coded(p, dst_gpu) for p in msg.pieces)
        sizes = [q.h * q.w if q is not None else p.nbytes for p, q in zip(msg.pieces, quants)]
        scales = sum(len(q.carried) for q in quants if q is not None)
        offsets, nbytes = layout(sizes + [4 * scales])
        elements = {1 if q is not None else ELEMENT_BYTES[tensors[p.tensor]["dtype"]] for p, q in zip(msg.pieces, quants)}
        if scales:
            elements.add(4)
        word = min(4, min(elements)) if elements else 4
        return CodedMessage(msg, quants, offsets, nbytes, scales, word)

    rounds = []
    for work in prog.rounds:
        copies = tuple((p, coded(p, rank)) for p in work.copies)
        aliased = tuple((_whole_piece(prog, a), None) for a in work.aliases)
        rounds.append(CodecRound(aliased + copies, tuple(message(m, m.peer) for m in work.sends),
                                 tuple(message(m, rank) for m in work.recvs)))
    amax_sends, amax_recvs = [], []
    for op in program["rounds"][0]["ops"] if program["rounds"] else ():
        if op["op"] != "amax" or rank not in (op["src"], op["dst"]):
            continue
        if op["src"] == rank:
            parts = []
            for entry in op["entries"]:
                mine = []
                for part in entry["parts"]:
                    boxes = before[(part["src_unit"], rank, entry["tensor"])]
                    box = as_box(part["box"])
                    index = next(i for i, b in enumerate(boxes) if all(lo <= a and c <= hi for (lo, hi), (a, c)
                                                                       in zip(b, box)))
                    mine.append((part["src_unit"], entry["tensor"], local_slices(boxes, index, box)))
                parts.append(tuple(mine))
            amax_sends.append(AmaxSend(op["dst"], tuple(parts)))
        else:
            blocks = tuple(((e["dst_unit"], e["gpu"], e["tensor"]), tuple(e["block"])) for e in op["entries"])
            for key, _ in blocks:
                shared[key] = grid(local_shape(after[key]), block)
            amax_recvs.append(AmaxRecv(op["src"], blocks))
    return CodecWork(prog, names, block, chunk, tuple(rounds), tuple(amax_sends), tuple(amax_recvs), shared)


def _one_tensor_each(prog: RankProgram) -> RankProgram:
    """`prog` with a v2 range's pieces and keeps cut into one per tensor: a codec moves each
    tensor's bytes apart (its own delta words or FP8 blocks)."""
    from dataclasses import replace

    from .keeps import Alias

    rounds = []
    for work in prog.rounds:
        aliases = tuple(Alias((name,), a.src_unit, a.dst_unit) for a in work.aliases for name in a.tensors)
        rounds.append(replace(work, aliases=aliases, copies=single_tensor_pieces(work.copies),
                              sends=tuple(replace(m, pieces=single_tensor_pieces(m.pieces)) for m in work.sends),
                              recvs=tuple(replace(m, pieces=single_tensor_pieces(m.pieces)) for m in work.recvs)))
    return replace(prog, rounds=tuple(rounds))


def _whole_piece(prog: RankProgram, alias) -> Piece:
    """A keep the dense program hands over in place, as a copy of the whole shard: a codec
    run writes into the receiver's own tensors, which never alias the training ones."""
    info = prog.after[alias.dst_unit][alias.tensor]
    whole = tuple(slice(0, n) for n in info.shape)
    return Piece((alias.tensor,), alias.src_unit, alias.dst_unit, whole, whole, _numel(info.shape), info.nbytes,
                 info.boxes[0], src_whole=True, dst_whole=True)


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
