"""The proof of a transition: its whole program emitted, verified against the module's
plans, and cut into the SHA-256 digest of every rank's part (docs/program.md, "Rank
programs"). Imports no torch: it runs in the runtime's process or in a prover process
beside it (`serve`, started by nereus.runtime.prover).

    verify_before_running(program, module) -> seconds         # or ProgramError
    prove(compiled, module, world_size) -> (seconds, digests)  # one digest per rank
    rank_part(compiled, rank) -> dict                          # rank's part (JSON program v1)
    serve(read_fd, write_fd)                                   # the prover process's loop

Input: a compiled transition and the module holding its plans. Output: the seconds the
proof took and, per rank of the process group, the digest its part must have.
Invariant: a digest comes out only for a program the verifier proved; a program that
fails raises ProgramError saying the runtime refuses it, with the verifier's message.
"""

from __future__ import annotations

import time

from nereus.ir.diagnostics import NereusError, ProgramError
from nereus.ir.model import Module
from nereus.ir.program import FORMAT, VERSION


def verify_before_running(program: dict, module: Module) -> float:
    """Prove `program` correct against `module`'s plans; the seconds it took.
    Raises ProgramError saying the runtime refuses it, with the verifier's located message."""
    from nereus.passes.verify import verify_program

    started = time.perf_counter()
    try:
        verify_program(program, against=module)
    except ProgramError as error:
        transition = program.get("transition", {}) if isinstance(program, dict) else {}
        raise ProgramError(f"the runtime refuses the program {transition.get('from')} -> {transition.get('to')}:"
                           f" it fails verification: {error.message}",
                           hint=error.hint or "recompile it; nereusc verify PROGRAM.json --against FILE.nir"
                                              " shows the same error") from None
    return time.perf_counter() - started


def rank_part(compiled, rank: int) -> dict:
    """`rank_program_json`, or for a rank beyond the cluster's GPUs (a process group larger
    than the plans' cluster) the empty part: every round, no op, no unit."""
    from .rank_json import rank_program_json

    if rank < compiled.dag.module.cluster.num_gpus:
        return rank_program_json(compiled, rank)
    dag = compiled.dag
    return {"format": FORMAT, "version": VERSION, "transition": {"from": dag.source, "to": dag.target},
            "rank": rank, "peers": [], "gpus": [], "nodes": [], "tensors": [], "units": {"before": [], "after": []},
            "resident_bytes": {}, "untouched": list(dag.untouched),
            "rounds": [{"ops": []} for _ in range(compiled.program.num_rounds)]}


def prove(compiled, module: Module, world_size: int) -> tuple[float, list]:
    """Prove the whole program once; (its seconds, the digest of every rank's part)."""
    from . import json_program
    from .rank_json import rank_digest, rank_digests

    whole = json_program.program_json(compiled)
    proof_s = verify_before_running(whole, module)
    digests = rank_digests(whole)
    del whole
    return proof_s, [digests[r] if r in digests else rank_digest(rank_part(compiled, r)) for r in range(world_size)]


def portable(error: Exception, source: str, target: str) -> NereusError:
    """The error as one that pickles and reads the same on every rank (a NereusError of
    the same type, or a ProgramError naming the transition and the exception)."""
    if isinstance(error, NereusError):
        return type(error)(error.message, loc=error.loc, hint=error.hint)
    return ProgramError(f"compiling {source} -> {target} failed: {type(error).__name__}: {error}")


AHEAD_KEEP = 64  # proofs the prover keeps (a digest list each), least recently made out first


def serve(read_fd: int, write_fd: int) -> None:
    """The prover process. Receives ("module", Module) once, then:
    ("prove", ticket, source, target, world_size, options): answered with ("ok", ticket,
    digests, seconds, made ahead) or ("error", ticket, NereusError, made ahead), one
    request at a time;
    ("plan", name, world_size): the runtime is in plan `name` now; while no request waits,
    the prover proves name -> every other plan of the module ahead, then every other plan
    -> name (default options), one at a time, so that a transition's proof is often done
    before it is asked for (a request arriving meanwhile waits for the proof in progress at
    most).
    Ends when its input closes (the runtime's process ended or closed it)."""
    import gc
    from collections import OrderedDict
    from multiprocessing.connection import Connection

    gc.disable()  # a proof allocates ~10^5 acyclic containers; nothing here outlives a request
    inbox, outbox = Connection(read_fd, writable=False), Connection(write_fd, readable=False)
    module, ahead = None, []
    done: OrderedDict = OrderedDict()  # (source, target, world_size, options) -> answer without its ticket
    while True:
        try:
            if ahead and not inbox.poll(0):
                _answer(module, ahead.pop(0), done)
                continue
            message = inbox.recv()
        except (EOFError, OSError):
            return
        if message[0] == "module":
            module = message[1]
        elif message[0] == "plan":
            _, name, world_size = message
            others = [p.name for p in module.plans if p.name != name and runs_on(module, p.name, world_size)]
            # from the plan, then the ways back to it as far as the kept answers hold both (a
            # job that switches back soon after finds that proof made too; answers already
            # kept are not made again)
            back = [(o, name, world_size, ()) for o in others][:max(0, AHEAD_KEEP - len(others))]
            ahead = [(name, o, world_size, ()) for o in others] + back
        else:
            _, ticket, source, target, world_size, options = message
            key = (source, target, world_size, tuple(sorted(options.items())))
            answer = _answer(module, key, done, ahead=False)
            try:
                outbox.send((answer[0], ticket) + answer[1:])
            except (BrokenPipeError, OSError):
                return


def runs_on(module: Module, plan: str, world_size: int) -> bool:
    """Whether every GPU of `plan` is a rank of a world of `world_size`."""
    return all(max(p.gpus) < world_size for p in module.plan(plan).placements)


def _answer(module: Module, key: tuple, done, ahead: bool = True) -> tuple:
    """The proof of `key` (source, target, world_size, options as sorted items): ("ok",
    digests, seconds, made ahead) or ("error", NereusError, made ahead); kept in `done`,
    made once (`ahead`: made before a request asked for it). A request for a key whose
    kept answer is an error proves it again (the error may have been passing: memory)."""
    from nereus.passes import compile_transition
    from nereus.passes.manager import PROGRAM_PIPELINE

    if key in done and (ahead or done[key][0] == "ok"):  # a request proves an error again
        done.move_to_end(key)
        return done[key]
    source, target, world_size, options = key
    try:
        seconds, digests = prove(compile_transition(module, source, target, pipeline=PROGRAM_PIPELINE, **dict(options)),
                                 module, world_size)
        answer = ("ok", digests, seconds, ahead)
    except Exception as error:  # noqa: BLE001 - every failure goes back as the rank's verdict
        answer = ("error", portable(error, source, target), ahead)
    done[key] = answer
    done.move_to_end(key)  # a proof made again is the newest
    while len(done) > AHEAD_KEEP:
        done.popitem(last=False)
    return answer


if __name__ == "__main__":
    import sys

    serve(int(sys.argv[1]), int(sys.argv[2]))
