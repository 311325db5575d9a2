"""Per-rank programs in the runtime: each rank obtains only its own part of a transition's
program (docs/program.md, "Rank programs"); no rank receives the whole program.

    obtain_rank_part(module, source, target, rank, world_size, control, verify) -> RankPart

Input: the parsed module (every rank holds it), the transition, this rank and the control
group. Output: this rank's part (a JSON program v1 dict with `rank` and `peers`, equal to
the whole program filtered to the rank) and its timings. Collective over `control`.

Design: every rank compiles the transition itself (the passes are deterministic: the same
module gives the same program on every process) and lowers only its own part
(`rank_program_json`): nothing is scattered, so a rank receives a few dozen bytes instead
of its part, and the compile runs in parallel on every rank instead of serially on one.
With `verify` (the default, the runtime's guarantee that it runs proven programs only)
rank 0 also emits the whole program once, proves it (`verify_before_running`), cuts the
SHA-256 digest of every rank's part out of it (`rank_digests`), drops it and scatters the
digests: each rank receives its own 64-character digest and compares it with the digest of
the part it lowered. A part that differs (another nereus version or .nir on that rank, a
nondeterministic pass, memory corruption) is refused on that rank with a ProgramError
naming both digests; one all_reduce then tells every other rank which rank refused, so
every rank raises and none waits on a peer that stopped. Without `verify`, no rank ever
builds the whole program.

With or without `verify`, `then` (the runtime's lowering: program.rank_program) refuses a
part whose keeps, copies and receives do not write the rank's new shards exactly once,
and the same all_reduce sums every rank's message balance (nereus.runtime.part_check): a
sender whose messages are not what their receiver expects makes every rank raise, naming
the pair, the round and the op.

With a `prover` (nereus.runtime.prover: a process beside rank 0) rank 0 asks for the proof
before lowering its own part and collects the digests after, so the two overlap; `then`
(e.g. the runtime's lowering of the part into its work list) runs on every rank between
its own lowering and the agreement, its errors refused like a lowering error.

Invariant: a rank executes a part only when every rank lowered (and checked) its part
without error, every pair of ranks agrees on the messages between them, and, with
`verify`, every part's digest equals the one cut from the proven whole program.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from nereus.backends import proof
from nereus.backends.rank_json import canonical_json
from nereus.ir.diagnostics import ProgramError
from nereus.ir.model import Module

from . import part_check


@dataclass(frozen=True)
class RankPart:
    program: Optional[dict]  # this rank's part (JSON program v1 with `rank` and `peers`); None when
    # it came lowered ahead (its `text` stands for it, its lowering is `then`)
    compile_s: float  # this rank: compile + lowering of its part (+ the digest agreement)
    proof_s: Optional[float]  # rank 0's global proof, seconds (None without verify)
    part_bytes: int  # size of the part's canonical JSON: what this rank holds of the program
    received_bytes: int  # bytes of program data this rank received (its digest, or 0)
    text: str = ""  # the part's canonical JSON (what the digest hashes; json.loads gives `program`)
    then: object = None  # what `then(text)` returned


def _lower_own_part(module: Module, source: str, target: str, rank: int, **options):
    """(compiled transition, this rank's part); `options` go to the passes (e.g. bucket).
    Module-level so that tests can corrupt a part."""
    from nereus.passes import compile_transition
    from nereus.passes.manager import PROGRAM_PIPELINE

    compiled = compile_transition(module, source, target, pipeline=PROGRAM_PIPELINE, **options)
    return compiled, proof.rank_part(compiled, rank)


def obtain_rank_part(module: Module, source: str, target: str, rank: int, world_size: int, control,
                     verify: bool = True, options: Optional[dict] = None, prover=None, then=None,
                     timeout_s: float = 120.0, ahead=None, work_of=None) -> RankPart:
    """Collective: this rank's part of the program `source -> target` (module docstring).
    Raises the same error on every rank when compiling or proving fails, and a ProgramError
    on every rank (the refusing rank's own message on that rank) when a part is refused.
    prover: rank 0's Prover, or None (inline); timeout_s: the control group's timeout (rank
    0 waits on the prover for half of it before proving inline). then: a function of the
    part's canonical JSON text, run on every rank before the agreement; its value is
    RankPart.then. ahead: this rank's part lowered before the call (nereus.runtime.ahead's
    Lowered: its text stands for the lowering, its value for what `then` would give, so
    `then` is not run; RankPart.program is then None); checked like a part lowered now.
    Used only without `options` (the thread lowers with the passes' defaults). work_of: the
    RankProgram in what `then` gave (program.rank_program, which refuses a part whose
    writes do not tile its new shards): its messages are compared with every peer's in the
    agreement, with or without `verify` (nereus.runtime.part_check)."""
    started = time.perf_counter()
    part, error, compiled, value = None, None, None, None
    ticket = prover.request(source, target, world_size, options) if verify and rank == 0 and prover else None
    if ahead is not None and not options:
        compiled, part, text, value = ahead.compiled, None, ahead.text, ahead.value
        then = None
    else:
        try:
            compiled, part = _lower_own_part(module, source, target, rank, **(options or {}))
        except Exception as caught:  # noqa: BLE001 - the other ranks wait on the agreement below
            error = proof.portable(caught, source, target)
        text = canonical_json(part) if part is not None else ""
    refusal = None  # an error of `then` (the part lowered: part_check refuses a wrong program there)
    if error is None and then is not None:
        try:
            value = then(text)
        except Exception as caught:  # noqa: BLE001 - refused like a part that does not lower
            refusal = proof.portable(caught, source, target)
    proof_s, received = None, 0
    if verify:
        # rank 0 proves, then every rank receives only its own verdict: ("ok", digest, seconds)
        verdicts: list = [None] * world_size
        if rank == 0:
            try:
                if error is not None:
                    if ticket is not None:
                        prover.forget(ticket)
                    raise error
                # at most half the control group's timeout: the other ranks wait for the
                # verdict in the scatter for timeout_s, and an inline proof must fit in the rest
                got = prover.result(ticket, timeout_s / 2) if ticket is not None else None
                if got is None:
                    if compiled is None:  # lowered ahead, and the prover did not answer
                        from nereus.passes import compile_transition
                        from nereus.passes.manager import PROGRAM_PIPELINE

                        compiled = compile_transition(module, source, target, pipeline=PROGRAM_PIPELINE,
                                                      **(options or {}))
                    proof_s, digests = proof.prove(compiled, module, world_size)
                elif got[0] == "error":
                    raise got[1]
                else:
                    digests, proof_s = got[1], got[2]
                verdicts = [("ok", d, proof_s) for d in digests]
            except Exception as caught:  # noqa: BLE001
                verdicts = [("error", proof.portable(caught, source, target))] * world_size
        mine: list = [None]
        dist.scatter_object_list(mine, verdicts if rank == 0 else None, src=0, group=control)
        verdict = mine[0]
        if verdict[0] == "error":
            raise verdict[1]  # every rank got the same error: no agreement round needed
        _, proved, proof_s = verdict
        received = len(proved)
        if error is None:
            digest = hashlib.sha256(text.encode()).hexdigest()
            if digest != proved:
                error = ProgramError(
                    f"rank {rank} refuses its part of the program {source} -> {target}: its digest {digest[:16]}… "
                    f"differs from {proved[:16]}…, the digest of rank {rank}'s part of the verified program",
                    hint="every rank must run the same nereus version on the same .nir (the part is lowered "
                         "on each rank; rank 0 proves the whole program)")
    del compiled
    error = error or refusal  # a part that differs from the proven one is refused as such first
    work = work_of(value) if error is None and value is not None and work_of is not None else None
    _agree(error, work, rank, world_size, control, source, target)
    return RankPart(part, time.perf_counter() - started, proof_s, len(text), received, text, value)


def _agree(error, work, rank: int, world_size: int, control, source: str, target: str) -> None:
    """Collective: every rank raises unless no rank refused its part and every sender's
    messages are what their receivers expect (part_check: the sum of every rank's balance
    is 0). One all_reduce; the texts that say why are gathered only when some rank refused
    or some pair disagrees."""
    balance = part_check.balance(work.pair_digests, rank) if work is not None else 0
    # [refusing ranks, the balance in 16-bit limbs]: a sum over 2^47 ranks cannot overflow
    row = torch.tensor([int(error is not None)] + [(balance >> (16 * i)) & 0xFFFF for i in range(4)],
                       dtype=torch.int64)
    dist.all_reduce(row, op=dist.ReduceOp.SUM, group=control)
    if int(row[0]) > 0:
        texts: list = [None] * world_size
        dist.all_gather_object(texts, error.message if error is not None else None, group=control)
        if error is not None:
            raise error
        first = next(r for r, text in enumerate(texts) if text is not None)
        raise ProgramError(f"rank {first} refused its part of the program {source} -> {target}; no rank runs it "
                           f"(rank {first}: {texts[first]})", hint=f"rank {first}'s error says why")
    if sum(int(limb) << (16 * i) for i, limb in enumerate(row[1:].tolist())) % (1 << 64) == 0:
        return
    # some sender packs what its receiver does not expect: find the pair, then the message
    views: list = [None] * world_size
    dist.all_gather_object(views, work.pair_digests if work is not None else (), group=control)
    pair = part_check.first_disagreeing_pair(views)
    messages: list = [None] * world_size
    mine = part_check.pair_messages(work, *pair) if pair is not None and rank in pair and work is not None else None
    dist.all_gather_object(messages, mine, group=control)
    why = part_check.disagreement(*pair, messages[pair[0]] or [], messages[pair[1]] or []) if pair is not None \
        else "the ranks' message digests do not add up"
    raise ProgramError(f"the parts of the program {source} -> {target} disagree: {why}; no rank runs it",
                       hint="every rank lowers its own part: the same nereus version, .nir and options "
                            "(direct_min_bytes) on every rank give parts whose messages match")
