"""Runs one rank's part of a weight-sync codec program, in place, step after step.

Input: this rank's `CodecWork` (codec_work.py), its source shards (the training weights,
never written) and its target shards (the generation weights the last run wrote, or none
yet). Output: the target shards written in place; per run the bytes it sent.
Invariant: after a run that returns, every element of every target shard equals the
sender's current value (dense or quantized); a run that fails on any rank raises on
every rank (TransitionAborted), and the caller then runs a full one next.

A run, per round of the dense program it encodes:
  - prologue (quantized targets, before round 0): each rank takes, for the blocks it
    writes without holding them whole, the amax of its own pieces' parts, sends every
    amax op's maxima and folds those it receives in (`given`), so that every writer of a
    block computes the block's scale from the whole block;
  - copies (and keeps) on the same GPU: `copy_`, or quantized into the target's codes
    and scales (nereus.runtime.fp8);
  - messages: the sender builds the message's bytes (pieces packed, quantized pieces as
    codes, then the scales the message carries). A full run sends them and keeps them as
    the message's reference. A delta run encodes them against the reference
    (delta_codec: the reference becomes the new bytes in the same pass) and sends the
    fixed-size head (header + directory) first, then the payload, whose size the head
    gives. The receiver of a delta packs what its targets hold of the message (its last
    result), applies the delta, compares the checksums with the sender's (taken over the
    sender's whole current message) and only then unpacks into its targets; a mismatch
    is a failure of the run.
A local failure is recorded, every op still posted (a failing sender's head says so, and
its receiver does not apply it), and the commit's collective raises it on every rank.
"""

from __future__ import annotations

import time
from typing import Optional

import torch
import torch.distributed as dist

from nereus.ir.diagnostics import NereusError, ProgramError
from nereus.models.fp8 import Fp8Weight
from nereus.ir.scale_blocks import grid

from . import delta_codec, fp8, packing
from .codec_work import CodecWork, CodedMessage
from .control import Failure, TransitionAborted, commit
from .wires import TORCH_DTYPES

class SyncAborted(TransitionAborted):
    """A codec sync that failed on some rank: raised on every rank. Unlike a transition's
    abort nothing was rolled back: targets may be partly written, and the next run of the
    WeightSync is a full one."""

    kind = "weight sync aborted"

    def __init__(self, failures: list, source: str, target: str):
        self.failures = failures
        NereusError.__init__(self, f"{source} -> {target} failed on every rank: "
                                   + "; ".join(str(f) for f in failures),
                             hint="the generation weights may be partly written: the next sync is a full one "
                                  "(it rewrites every element)")


AMAX_TAG = 1 << 20  # tags of the prologue's maxima; a delta's payload follows its head at tag + PAYLOAD_TAG
PAYLOAD_TAG = 1 << 21


class CodecSync:
    """One plan's codec sync on this rank (module docstring). `references` holds the
    bytes of every message this rank sent last (delta programs only)."""

    def __init__(self, work: CodecWork, source: str, target: str, device: torch.device, group, control,
                 rank: Optional[int] = None):
        """rank: this process's rank (default: torch.distributed's); a benchmark that builds
        every rank's messages in one process passes it."""
        self.work, self.source, self.target = work, source, target
        self.device, self.group, self.control = torch.device(device), group, control
        self.rank = dist.get_rank() if rank is None else rank
        self.references: dict = {}  # (round, op index) -> uint8 tensor
        self.targets: Optional[dict] = None  # the target shards it keeps when the caller passes none
        self._indices: dict = {}  # QuantPiece -> (index of its carried scales among its blocks, their place)

    # -- targets ---------------------------------------------------------------------------

    def new_targets(self) -> dict:
        """Zeroed target shards of this rank: {name: tensor | Fp8Weight}."""
        out = {}
        for unit, shards in self.work.prog.after.items():
            for name, info in shards.items():
                if name in self.work.quantized:
                    out[name] = Fp8Weight.empty(info.shape, self.device, self.work.block)
                else:
                    out[name] = torch.zeros(info.shape, dtype=TORCH_DTYPES[info.dtype], device=self.device)
        return out

    def check_targets(self, targets: dict) -> None:
        for unit, shards in self.work.prog.after.items():
            for name, info in shards.items():
                t = targets.get(name)
                if name in self.work.quantized:
                    ok = isinstance(t, Fp8Weight) and tuple(t.codes.shape) == info.shape and \
                        tuple(t.scales.shape) == grid(info.shape, self.work.block)
                else:
                    ok = isinstance(t, torch.Tensor) and tuple(t.shape) == info.shape and \
                        t.dtype == TORCH_DTYPES[info.dtype] and t.is_contiguous()
                if not ok:
                    raise ProgramError(f"the target shard of {name} is not the {'FP8 ' if name in self.work.quantized else ''}"
                                       f"{info.shape} {info.dtype} tensor the sync writes",
                                       hint="pass the shards the last run returned (into=...)")

    # -- a run -----------------------------------------------------------------------------

    def run(self, source_state: dict, targets: dict, full: bool) -> dict:
        """Collective (module docstring). Returns this rank's figures: seconds,
        bytes_sent, bytes_received, bytes_copied, dense_bytes (what a full run sends)."""
        started = time.perf_counter()
        sources = {unit: {name: source_state[name] for name in shards if name in source_state}
                   for unit, shards in self.work.prog.before.items()}
        figures = {"bytes_sent": 0, "bytes_received": 0, "bytes_copied": 0,
                   "dense_bytes": sum(m.nbytes for r in self.work.rounds for m in r.sends)}
        failure = None
        with torch.no_grad():
            try:
                given = self._prologue(sources)
            except Exception as error:  # noqa: BLE001 - reported at the commit on every rank
                failure, given = Failure(self.rank, -1, "amax prologue", None, f"{type(error).__name__}: {error}"), {}
            for k, rnd in enumerate(self.work.rounds):
                failure = self._round(k, rnd, sources, targets, given, full, figures, failure)
            if self.device.type == "cuda":
                torch.cuda.current_stream(self.device).synchronize()
        try:
            commit(failure, (figures["bytes_sent"],), self.control, self.source, self.target)
        except TransitionAborted as error:
            self.references.clear()
            raise SyncAborted(error.failures, self.source, self.target) from None
        figures["seconds"] = time.perf_counter() - started
        return figures

    def _prologue(self, sources: dict) -> dict:
        """{receiving shard: amax per block ([rows, cols], -1 where unknown)} of the blocks
        this rank shares with other writers (module docstring)."""
        work = self.work
        given = {key: torch.full(shape, -1.0, dtype=torch.float32, device=self.device)
                 for key, shape in work.shared.items()}
        for rnd in work.rounds:
            pieces = list(rnd.copies) + [(p, q) for m in rnd.sends for p, q in zip(m.msg.pieces, m.quant)]
            for p, q in pieces:
                if q is not None and q.shared:
                    partial = fp8.block_amax(self._src(sources, p), q.row0, q.col0, work.block)
                    table = given[q.shard]
                    for a, b in q.shared:
                        table[q.i0 + a, q.j0 + b] = torch.maximum(table[q.i0 + a, q.j0 + b], partial[a, b])
        if not work.amax_sends and not work.amax_recvs:
            return given
        ops, inbox = [], []
        for n, out in enumerate(work.amax_sends):
            values = torch.stack([torch.stack([sources[unit][name][slices].abs().max().float()
                                               for unit, name, slices in parts]).max() for parts in out.parts])
            ops.append(dist.P2POp(dist.isend, values.to(self.device), out.peer, self.group, AMAX_TAG))
        for n, into in enumerate(work.amax_recvs):
            inbox.append(torch.empty(len(into.blocks), dtype=torch.float32, device=self.device))
            ops.append(dist.P2POp(dist.irecv, inbox[-1], into.peer, self.group, AMAX_TAG))
        for request in dist.batch_isend_irecv(ops):
            request.wait()
        for into, values in zip(work.amax_recvs, inbox):
            for (key, (i, j)), value in zip(into.blocks, values):
                given[key][i, j] = torch.maximum(given[key][i, j], value)
        return given

    def _round(self, k: int, rnd, sources, targets, given, full: bool, figures: dict, failure):
        step, peer = "copy", None
        outgoing = []
        try:
            if failure is None:
                for p, q in rnd.copies:
                    if q is None:
                        self._dst(targets, p).copy_(self._src(sources, p))
                    else:
                        self._quantize(sources, targets, p, q, given)
                    figures["bytes_copied"] += p.numel if q is not None else p.nbytes
        except Exception as error:  # noqa: BLE001
            failure = failure or Failure(self.rank, k, step, peer, f"{type(error).__name__}: {error}")
        for m in rnd.sends:
            buffer, flags = None, 0
            try:
                if failure is None:
                    buffer = self._build(m, sources, given)
            except Exception as error:  # noqa: BLE001
                failure = Failure(self.rank, k, f"build message to {m.msg.peer}", m.msg.peer,
                                  f"{type(error).__name__}: {error}")
            if buffer is None:
                buffer, flags = torch.zeros(m.nbytes, dtype=torch.uint8, device=self.device), delta_codec.FAILED
            outgoing.append((m, buffer, flags))
        if full or self.work.chunk is None:
            return self._exchange_full(k, rnd, outgoing, targets, figures, failure)
        return self._exchange_delta(k, rnd, outgoing, targets, figures, failure)

    def _exchange_full(self, k, rnd, outgoing, targets, figures, failure):
        inbox = [torch.empty(m.nbytes, dtype=torch.uint8, device=self.device) for m in rnd.recvs]
        ops = [dist.P2POp(dist.isend, buf, m.msg.peer, self.group, m.msg.op_index) for m, buf, _ in outgoing]
        ops += [dist.P2POp(dist.irecv, buf, m.msg.peer, self.group, m.msg.op_index) for m, buf in zip(rnd.recvs, inbox)]
        _wait(ops)
        for m, buf, _ in outgoing:
            figures["bytes_sent"] += m.nbytes
            if self.work.chunk is not None:
                self.references[(k, m.msg.op_index)] = buf
        for m, buf in zip(rnd.recvs, inbox):
            figures["bytes_received"] += m.nbytes
            if failure is None:
                try:
                    self._apply(m, buf, targets)
                except Exception as error:  # noqa: BLE001
                    failure = Failure(self.rank, k, f"unpack message from {m.msg.peer}", m.msg.peer,
                                      f"{type(error).__name__}: {error}")
        return failure

    def _exchange_delta(self, k, rnd, outgoing, targets, figures, failure):
        chunk = self.work.chunk
        coded = []
        for m, buf, flags in outgoing:
            reference = self.references.get((k, m.msg.op_index))
            if reference is None or flags:
                head = torch.zeros(delta_codec.coded_bytes(m.nbytes, m.word, chunk), dtype=torch.uint8,
                                   device=self.device)
                head[:delta_codec.HEADER_BYTES].view(torch.int64)[3] = delta_codec.FAILED
                payload = torch.zeros(0, dtype=torch.uint8, device=self.device)
                if reference is None and failure is None:
                    failure = Failure(self.rank, k, f"delta to {m.msg.peer}", m.msg.peer,
                                      "no reference of the last run of this program")
            else:
                head, payload = delta_codec.encode(buf, reference, m.word, chunk)
            coded.append((m, head, payload))
        heads = [torch.empty(delta_codec.coded_bytes(m.nbytes, m.word, chunk), dtype=torch.uint8, device=self.device)
                 for m in rnd.recvs]
        ops = [dist.P2POp(dist.isend, head, m.msg.peer, self.group, m.msg.op_index) for m, head, _ in coded]
        ops += [dist.P2POp(dist.irecv, head, m.msg.peer, self.group, m.msg.op_index) for m, head in zip(rnd.recvs, heads)]
        _wait(ops)
        sizes = [delta_codec.header_of(head)[0] for head in heads]
        sent = [(m, head, payload[:delta_codec.header_of(head)[0]]) for m, head, payload in coded]
        payloads = [torch.empty(n, dtype=torch.uint8, device=self.device) for n in sizes]
        tag = PAYLOAD_TAG
        ops = [dist.P2POp(dist.isend, p, m.msg.peer, self.group, tag + m.msg.op_index) for m, _, p in sent if p.numel()]
        ops += [dist.P2POp(dist.irecv, p, m.msg.peer, self.group, tag + m.msg.op_index)
                for m, p in zip(rnd.recvs, payloads) if p.numel()]
        _wait(ops)
        for m, head, payload in sent:
            figures["bytes_sent"] += head.numel() + payload.numel()
        for m, head, payload in zip(rnd.recvs, heads, payloads):
            figures["bytes_received"] += head.numel() + payload.numel()
            _, total, weighted, flags = delta_codec.header_of(head)
            if failure is not None or flags:
                continue  # the sender's own failure is reported at the commit
            try:
                current = self._current(m, targets)
                got = delta_codec.decode(current, head, payload, m.word, chunk)
                if got != (total, weighted):
                    raise ProgramError(f"the delta from GPU {m.msg.peer} (op {m.msg.op_index}) applied to this "
                                       f"rank's last result gives checksums {got}, the sender's message has "
                                       f"{(total, weighted)}")
                self._apply(m, current, targets)
            except Exception as error:  # noqa: BLE001
                failure = Failure(self.rank, k, f"apply delta from {m.msg.peer}", m.msg.peer,
                                  f"{type(error).__name__}: {error}")
        return failure

    # -- pieces and messages ---------------------------------------------------------------

    @staticmethod
    def _src(sources: dict, p) -> torch.Tensor:
        return sources[p.src_unit][p.tensor][p.src_slices]

    def _dst(self, targets: dict, p) -> torch.Tensor:
        t = targets[p.tensor]
        if isinstance(t, Fp8Weight):
            return t.codes.view(torch.uint8)[p.dst_slices]
        return t[p.dst_slices]

    def _index(self, q) -> tuple:
        found = self._indices.get(q)
        if found is None:
            tj = -(-(q.col0 % self.work.block + q.w) // self.work.block)
            found = self._indices[q] = (
                torch.tensor([a * tj + b for a, b in q.carried], dtype=torch.int64, device=self.device),
                torch.tensor(q.scale_index, dtype=torch.int64, device=self.device))
        return found

    def _given(self, q, given: dict):
        if not q.shared:
            return None
        block = self.work.block
        ti, tj = -(-(q.row0 % block + q.h) // block), -(-(q.col0 % block + q.w) // block)
        out = torch.full((ti, tj), -1.0, dtype=torch.float32, device=self.device)
        table = given[q.shard]
        for a, b in q.shared:
            out[a, b] = table[q.i0 + a, q.j0 + b]
        return out

    def _quantize(self, sources, targets, p, q, given) -> None:
        """A same-GPU copy of a quantized piece: codes into the target, its scales too."""
        t = targets[p.tensor]
        _, scales = fp8.quantize(self._src(sources, p), q.row0, q.col0, self.work.block, self._given(q, given),
                                 codes=t.codes.view(torch.uint8)[p.dst_slices])
        relative, place = self._index(q)
        t.scales.view(-1).index_copy_(0, place, scales.view(-1).index_select(0, relative))

    def _build(self, m: CodedMessage, sources: dict, given: dict) -> torch.Tensor:
        """The message's bytes (module docstring); padding zero, so a delta sees only data."""
        buf = torch.zeros(m.nbytes, dtype=torch.uint8, device=self.device)
        views, offsets, at = [], [], 0
        scale_region = buf[m.offsets[-1]:m.offsets[-1] + 4 * m.scales].view(torch.float32)
        for p, q, offset in zip(m.msg.pieces, m.quant, m.offsets):
            if q is None:
                views.append(self._src(sources, p))
                offsets.append(offset)
                continue
            codes = buf[offset:offset + q.h * q.w].view(q.h, q.w)
            _, scales = fp8.quantize(self._src(sources, p), q.row0, q.col0, self.work.block, self._given(q, given),
                                     codes=codes)
            relative, _ = self._index(q)
            scale_region[at:at + len(q.carried)] = scales.view(-1).index_select(0, relative)
            at += len(q.carried)
        if views:
            packing.pack(views, offsets, m.nbytes, out=buf)
        return buf

    def _current(self, m: CodedMessage, targets: dict) -> torch.Tensor:
        """What this rank's targets hold of a message it receives, as the message's bytes."""
        buf = torch.zeros(m.nbytes, dtype=torch.uint8, device=self.device)
        views, offsets, at = [], [], 0
        scale_region = buf[m.offsets[-1]:m.offsets[-1] + 4 * m.scales].view(torch.float32)
        for p, q, offset in zip(m.msg.pieces, m.quant, m.offsets):
            views.append(self._dst(targets, p) if q is None else None)
            offsets.append(offset)
            if q is not None:
                buf[offset:offset + q.h * q.w].view(q.h, q.w).copy_(self._dst(targets, p))
                _, place = self._index(q)
                scale_region[at:at + len(q.carried)] = targets[p.tensor].scales.view(-1).index_select(0, place)
                at += len(q.carried)
        dense = [(v, o) for v, o in zip(views, offsets) if v is not None]
        if dense:
            packing.pack([v for v, _ in dense], [o for _, o in dense], m.nbytes, out=buf)
        return buf

    def _apply(self, m: CodedMessage, buf: torch.Tensor, targets: dict) -> None:
        """Unpack a message's bytes into this rank's targets."""
        dense, at = [], 0
        scale_region = buf[m.offsets[-1]:m.offsets[-1] + 4 * m.scales].view(torch.float32)
        for p, q, offset in zip(m.msg.pieces, m.quant, m.offsets):
            if q is None:
                dense.append((self._dst(targets, p), offset))
                continue
            self._dst(targets, p).copy_(buf[offset:offset + q.h * q.w].view(q.h, q.w))
            _, place = self._index(q)
            targets[p.tensor].scales.view(-1).index_copy_(0, place, scale_region[at:at + len(q.carried)])
            at += len(q.carried)
        if dense:
            packing.unpack(buf, [v for v, _ in dense], [o for _, o in dense])


def _wait(ops: list) -> None:
    if ops:
        for request in dist.batch_isend_irecv(ops):
            request.wait()
