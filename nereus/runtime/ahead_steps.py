"""The work of one transition that the lowering-ahead thread (nereus.runtime.ahead) runs
a step at a time: this rank's part lowered (by the lowering process, nereus.runtime.lowerer,
or here), its execution plan, on CUDA its streams' kernel variants, then its replays and
their variants. Input: the module, this rank, the (source, target) pair. Output: a
generator whose first value other than WAITING is a `Lowered` (what the runtime takes),
each later yield one more step done, named ("plan", "streams", "compile", "replay": the
thread's step log shows them); LATER marks where what a first call needs is done.
Invariant: no step runs a collective or touches a registered tensor, and what it leaves
(the plan, replays, compiled variants) is what the transition would build itself.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Iterator

import torch

from . import packing, replay, streams
from .execution_plan import plan_for
from .program import lower_text

log = logging.getLogger("nereus.ahead")
WAITING = "waiting"  # what a step yields while its lowering is not in yet (see the module docstring)
LATER = "later"  # what a step yields when the rest of its pair can wait for the other pairs'
LOWERER_POLL_S = 0.05  # one step's wait for the lowering process (the step that gets the answer also loads it)


class LoweringFailed(RuntimeError):
    """The lowering process could not lower a transition (the transition, lowering it
    itself, raises the error with its location)."""


@dataclass(frozen=True)
class Lowered:
    """A transition's part as this rank lowered it ahead (the first step's value)."""

    text: str  # the part's canonical JSON (what its digest hashes)
    value: tuple  # lower_part(text, ...): (PartFacts, this rank's RankProgram)
    compiled: object  # the compiled transition (rank 0 without a prover proves it inline), else None
    seconds: float  # the thread's time to lower it (with the lowering process: to have it)
    where: str = "thread"  # or "process": lowered by the lowering process (nereus.runtime.lowerer)


def lower_part(text: str, rank: int, direct_min_bytes: int) -> tuple:
    """(PartFacts of the part, this rank's work list from it), its execution plan built
    too (kept by execution_plan.plan_for): what a runtime needs of a new part."""
    facts, lowered = lower_text(text, rank, direct_min_bytes)
    plan_for(lowered, streams.CHUNK_BYTES)
    return facts, lowered


def steps(module, rank: int, device, direct_min_bytes: int, keep_compiled: bool, lowerer, source: str,
          target: str) -> Iterator:
    """The work of one transition, a step per yield: lower this rank's part (yields a
    Lowered; where `lowerer` (a lowerer.Lowerer) runs, it lowers and each step until its
    answer is in waits for it at most LOWERER_POLL_S and yields WAITING; the execution plan
    is then a step of its own); on CUDA, compile its streams' kernel variants, yield LATER,
    then build its replays (the execution plan's, as Runtime.prepare does) one per step,
    each followed by its variants not compiled yet, one per step, on a stream of the
    thread's own (a step never waits for the training's queued work). What the runtime's
    own transition would otherwise do in its first and second calls. `device`: an indexed
    device (this thread's current device is GPU 0 whatever the main thread's is)."""
    from nereus.backends.rank_json import canonical_json

    from .distribute import _lower_own_part

    started = time.perf_counter()
    done = None
    ticket = lowerer.request(source, target) if lowerer is not None and not keep_compiled else None
    try:
        while ticket is not None:
            answer = lowerer.answer(ticket, LOWERER_POLL_S)
            if answer is None:
                yield WAITING
                continue
            ticket = None
            if answer[0] == "ok":
                got = answer[1]
                done = Lowered(got.text, (got.facts, got.program), None, time.perf_counter() - started, "process")
            elif answer[0] == "error":  # the transition lowers it itself and raises this there
                raise LoweringFailed(f"the lowering process could not lower {source} -> {target}: {answer[1]}")
            else:  # gone: lowered here instead
                log.debug("lowering process: %s -> %s %s", source, target, answer[1])
    finally:
        if ticket is not None:  # dropped while waiting (at_plan, close): its answer is not kept when it comes
            lowerer.forget(ticket)
    if done is None:
        compiled, part = _lower_own_part(module, source, target, rank)
        text = canonical_json(part)
        done = Lowered(text, lower_part(text, rank, direct_min_bytes), compiled if keep_compiled else None,
                       time.perf_counter() - started)
        del compiled, part
    value, where = done.value, done.where
    yield done
    del done
    if where == "process":  # its execution plan (torch's meta tensors: not built there)
        plan_for(value[1], streams.CHUNK_BYTES)
        yield "plan"
    device = torch.device(device)
    kernels = packing.kernels()
    if device.type != "cuda" or kernels is None or not hasattr(kernels, "warm"):
        return
    from .executor import TORCH_DTYPES
    from .prepare import stream_classes

    facts, lowered = value
    del value
    packer = kernels.default_packer()
    with torch.cuda.device(device):
        stream = torch.cuda.Stream(device)
        streamed = stream_classes(lowered, device, TORCH_DTYPES, facts.offloaded)
    yield "streams"
    # the stream variants before the replays: a first call that comes while the replays
    # are built streams on compiled kernels (a chunk whose variant is missing takes the
    # torch path: ~100 of them cost a first call of the 6-layer MoE change ~0.4 s on one
    # H200, session 15)
    yield from _compile_each(packer, streamed, device, stream)
    yield LATER  # what a first call needs is done: the other pairs' first, then the replays
    # one replay a step, its variants compiled right after it: a call that comes meanwhile
    # waits for one replay's build, and finds the replays built so far runnable
    built = replay.warm_steps(lowered, plan_for(lowered, streams.CHUNK_BYTES), device, streams.DEPTH,
                              facts.offloaded)
    del facts, lowered
    while True:
        with torch.cuda.device(device), torch.cuda.stream(stream):
            variants = next(built, None)
        if variants is None:
            return
        stream.synchronize()  # its tables are on the device before a call may use them
        yield "replay"
        yield from _compile_each(packer, variants, device, stream)


def _compile_each(packer, variants, device, stream) -> Iterator:
    """Compile the `variants` not compiled yet on `stream`, one per step."""
    for variant in sorted(variants):
        if variant not in packer.compiled:
            with torch.cuda.device(device), torch.cuda.stream(stream):
                packer.compile({variant}, device)
            yield "compile"


# -- running the generator (the thread and the caller alike) --------------------------------

def step_name(value) -> str:
    """What a step was, for the step log: WAITING, LATER and the steps' names are strings
    ("plan", "replay", ...); any other value is a "step"."""
    return value if isinstance(value, str) else "step"


def close_steps(generator) -> None:
    """Close a started step generator (its cleanup failing loses nothing)."""
    try:
        if generator is not None:
            generator.close()
    except Exception:  # noqa: BLE001
        pass


def first_value(generator, wait_s: float):
    """Run `generator` to its first value other than WAITING (its lowering); None where it
    ends or raises first, or is still WAITING after `wait_s` (the caller then lowers
    itself, and raises there)."""
    end = time.monotonic() + wait_s
    try:
        while True:
            value = next(generator)
            if value is not WAITING and value is not LATER:
                return value
            if time.monotonic() >= end:
                log.debug("lowering ahead: still waiting for the lowering process after %.1f s", wait_s)
                return None
    except Exception as error:  # noqa: BLE001 - StopIteration too: the caller lowers (and raises) itself
        log.debug("lowering ahead failed: %r", error)
        return None
