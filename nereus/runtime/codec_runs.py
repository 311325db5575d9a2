"""A WeightSync's codec runs (delta, FP8 targets; docs/program.md, "Weight-sync codecs"):
which program each plan runs, and whether a run is full or delta.

Input: the WeightSync (module, stages, mode, full_every, groups, device) and, per run, a
plan, this rank's source weights and, optionally, the target shards to write. Output: a
SyncResult whose weights are the targets, written in place. Invariant: a run is delta
only when every rank's last successful run was of the same program into the same target
tensors and `full_every` does not ask for a full one (one all_reduce decides it, so all
ranks agree); a failure leaves the next run full.

Programs are cached by their digest: two plans whose syncs compile alike share one
CodecSync (and its references), so a plan change that leaves the sync alone keeps
sending deltas.
"""

from __future__ import annotations

import time
from typing import Optional

import torch
import torch.distributed as dist

from nereus.ir.diagnostics import ProgramError

from .runtime import known_plan


class CodecRuns:
    """The codec programs of one WeightSync and the state between its runs."""

    def __init__(self, sync):
        self.sync = sync  # the WeightSync
        self._syncs: dict = {}  # digest of a codec program -> its CodecSync on this rank (None: untouched)
        self._plans: dict = {}  # plan -> (digest, compile seconds)
        self._last: Optional[tuple] = None  # (digest, target identity) of the last run that succeeded
        self._since_full = 0

    def codec(self, plan: str):
        """Collective: this rank's CodecSync of `plan`'s codec program and compile seconds,
        cached. Every rank compiles the whole program (deterministic) and lowers its own
        work; with `verify_programs` rank 0 proves it (nereus.passes.verify, verify_codec);
        one all_gather of every rank's digest (or error) then makes every rank raise when
        any rank failed or holds another program."""
        ws = self.sync
        if plan not in self._plans:
            import hashlib

            from nereus.backends.rank_json import canonical_json

            from .codec_sync import CodecSync
            from .codec_work import lower

            known_plan(ws.module, plan)
            started = time.perf_counter()
            rank, error, work, digest = dist.get_rank(), None, None, None
            try:
                program = ws.compile_program(plan)
                digest = hashlib.sha256(canonical_json(program).encode()).hexdigest()
                if ws.verify_programs and rank == 0:
                    from nereus.passes.verify import verify_program

                    verify_program(program)
                if not program.get("untouched"):
                    work = lower(program, rank)
            except Exception as caught:  # noqa: BLE001 - every rank must raise
                error = f"{type(caught).__name__}: {getattr(caught, 'message', caught)}"
            views: list = [None] * dist.get_world_size()
            dist.all_gather_object(views, (digest, error), group=ws.control)
            failed = [(r, e) for r, (_, e) in enumerate(views) if e is not None]
            if failed:
                raise ProgramError(f"the weight sync of plan {plan} could not be compiled on rank {failed[0][0]}: "
                                   f"{failed[0][1]}", hint="every rank compiles it; rank 0 also proves it")
            if len({d for d, _ in views}) != 1:
                raise ProgramError(f"the ranks compiled different weight-sync programs for plan {plan}",
                                   hint="every rank must run the same nereus version on the same .nir")
            if digest not in self._syncs:
                group = ws.data_group[0] if isinstance(ws.data_group, (list, tuple)) else ws.data_group
                self._syncs[digest] = CodecSync(work, *ws.transition, ws.device, group, ws.control) \
                    if work is not None else None
            self._plans[plan] = (digest, time.perf_counter() - started)
        digest, compile_s = self._plans[plan]
        return self._syncs[digest], compile_s

    def run(self, plan: str, weights: dict, into: Optional[dict]) -> tuple:
        """Collective: one codec run of `plan` (module docstring); `weights`: this rank's
        source shards (weights only). Returns (targets, figures: seconds, bytes_sent,
        bytes_received, bytes_copied, bytes_kept, rounds, compile_s, full, dense_bytes,
        reference_bytes)."""
        ws = self.sync
        sync, compile_s = self.codec(plan)
        digest = self._plans[plan][0]
        if sync is None:  # untouched: both layouts are one and nothing is quantized
            out = dict(weights) if into is None else into
            if into is not None:
                for name, tensor in into.items():
                    tensor.copy_(weights[name])
            kept = sum(t.numel() * t.element_size() for t in weights.values())
            return out, {"seconds": 0.0, "bytes_sent": 0, "bytes_received": 0, "bytes_copied": 0, "bytes_kept": kept,
                         "rounds": 0, "compile_s": compile_s, "full": True, "dense_bytes": 0, "reference_bytes": 0}
        targets = into if into is not None else getattr(sync, "targets", None)
        if targets is None:
            targets = sync.new_targets()
        identity = tuple(sorted((name, (t.codes if hasattr(t, "codes") else t).data_ptr()) for name, t in targets.items()))
        want_full = sync.work.chunk is None or self._last != (digest, identity) or \
            (ws.full_every > 0 and self._since_full + 1 >= ws.full_every)
        flag = torch.tensor([int(want_full)], dtype=torch.int64)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=ws.control)  # a full run when any rank needs one
        full = bool(int(flag))
        self._last = None  # set again only when this run succeeds on every rank
        for other in self._syncs.values():  # another program's shards and references are stale now
            if other is not None and other is not sync:
                other.targets = None
                other.references.clear()
        sync.check_targets(targets)
        figures = sync.run(weights, targets, full)
        self._last, self._since_full = (digest, identity), (0 if full else self._since_full + 1)
        if into is None:
            sync.targets = targets
        return targets, {**figures, "bytes_kept": 0, "rounds": len(sync.work.rounds), "compile_s": compile_s,
                         "full": full, "reference_bytes": sync.work.reference_bytes}
