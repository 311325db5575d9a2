"""A prover process beside rank 0: the proof of a transition's whole program runs there
while this process lowers its own part.

Why: with verify_programs (the default) rank 0 proves every new transition's whole
program before any rank runs it: emit it, replay it symbolically, cut every rank's
digest. On a cold 6-layer Qwen3-30B-A3B change on one H200 that was 0.5-0.9 s of a 2-2.7
s first call, serial with rank 0's own lowering (0.5-0.7 s), all under one GIL. The
prover is a plain Python process (the passes import no torch: it starts in a few tenths
of a second) that holds the module, compiles the transition itself (the passes are
deterministic) and proves it; rank 0 asks before lowering its part and collects the
digests after (nereus.runtime.distribute), so the first call costs the longer of the two.

    Prover(module)                        # starts the process (rank 0, at Runtime construction)
    prover.at_plan(plan, world_size)      # the runtime is in `plan`: prove its transitions ahead
    ticket = prover.request(source, target, world_size, options)
    prover.result(ticket, timeout_s)      # ("ok", digests, seconds, ahead) | ("error", NereusError, ahead) | None
    prover.close()

While idle, the process proves the transitions from the runtime's current plan to every
other plan ahead, then the ways back to it (in the module's order; NEREUS_PROVE_AHEAD=0: not): a transition asked
for after that finds its proof made. A request waits at most for the proof in progress.

Invariant: the digests come from the same proof as the inline one (nereus.backends.proof);
`result` returns None (the caller proves inline) when the process is gone, failed to
start or did not answer within timeout_s, and then the process is ended: a proof is never
waited on forever and never skipped.

Setting: Runtime(prover=...) or NEREUS_PROVER: "process", "inline", or "auto" (the
default: a process for CUDA devices, where the host's time is the transition's; inline on
CPU, where tests and gloo runs would start a process per runtime for little gain).
"""

from __future__ import annotations

import itertools
import logging
import os
import time
from typing import Optional

from nereus.ir.diagnostics import NereusError, env_flag

from . import child

log = logging.getLogger("nereus.prover")
MODES = ("auto", "process", "inline")
# prove the transitions from the current plan while idle (docs/runtime.md, "Environment variables")
AHEAD = env_flag("NEREUS_PROVE_AHEAD", True)


def prover_mode(requested: Optional[str], device_type: str) -> str:
    """"process" or "inline" for a runtime on `device_type` (argument, else NEREUS_PROVER,
    else auto)."""
    mode = requested or os.environ.get("NEREUS_PROVER") or "auto"
    if mode not in MODES:
        raise NereusError(f"unknown prover mode {mode!r}",
                          hint="prover='auto' (a process on CUDA), 'process' or 'inline' (NEREUS_PROVER)")
    if mode == "auto":
        return "process" if device_type == "cuda" else "inline"
    return mode


class Prover:
    """The parent's end of one prover process (module docstring). The process ends when
    `close` is called, when the Prover is garbage collected, or at exit."""

    def __init__(self, module):
        self._tickets = itertools.count()
        self._answers: dict = {}
        self._pending: set = set()  # tickets asked for and not yet collected or forgotten
        # ends when this Prover is closed or collected, or at exit (a Runtime dropped, or never closed)
        self._ends, self._finalizer = child.owned_by(self)
        try:
            child.start("nereus.backends.proof:serve", self._ends)
            self._ends.outbox.send(("module", module))
        except Exception as error:  # noqa: BLE001 - no process: every proof runs inline, on rank 0 as before
            log.warning("prover process did not start (%s: %s); proving inline", type(error).__name__, error)
            self.close()

    @property
    def alive(self) -> bool:
        process = self._ends.process
        return process is not None and process.poll() is None

    def at_plan(self, plan: str, world_size: int) -> None:
        """The runtime is in `plan` now: while idle, the process proves the transitions from
        it to every other plan ahead, then the ways back to it (NEREUS_PROVE_AHEAD=0: not)."""
        if AHEAD and self.alive:
            try:
                self._ends.outbox.send(("plan", plan, world_size))
            except (OSError, ValueError):
                self.close()

    def request(self, source: str, target: str, world_size: int, options: Optional[dict] = None) -> Optional[int]:
        """Ask for the proof of source -> target; its ticket, or None (the caller proves inline)."""
        if not self.alive:
            return None
        ticket = next(self._tickets)
        try:
            self._ends.outbox.send(("prove", ticket, source, target, world_size, dict(options or {})))
        except (OSError, ValueError):
            self.close()
            return None
        self._pending.add(ticket)
        return ticket

    def forget(self, ticket: Optional[int]) -> None:
        """The caller will not collect `ticket` (its own lowering failed): its answer is dropped."""
        self._pending.discard(ticket)
        self._answers.pop(ticket, None)

    def result(self, ticket: Optional[int], timeout_s: float) -> Optional[tuple]:
        """("ok", digests, seconds, ahead) or ("error", NereusError, ahead) for `ticket`
        (ahead: proven before it was asked for); None when the process cannot give it
        (gone, or silent for timeout_s in all): the caller proves inline."""
        if ticket is None or ticket not in self._pending:
            return None
        deadline = time.monotonic() + timeout_s
        while ticket not in self._answers:
            try:
                if not self._ends.inbox.poll(max(0.0, deadline - time.monotonic())):
                    log.warning("prover process silent for %.1f s; proving inline", timeout_s)
                    self._ends.kill()  # at once: the inline proof needs the rest of the budget
                    self.close()
                    return None
                answer = self._ends.inbox.recv()
            except Exception as error:  # noqa: BLE001 - ended (EOF), killed, or an answer that does not load
                if not isinstance(error, EOFError):
                    log.warning("prover process failed (%s: %s); proving inline", type(error).__name__, error)
                self.close()
                return None
            if answer[1] in self._pending:  # else forgotten: dropped
                self._answers[answer[1]] = answer
        self._pending.discard(ticket)
        answer = self._answers.pop(ticket)
        return answer[:1] + answer[2:]  # without its ticket

    def close(self) -> None:
        """End the process (it exits when its input closes; killed if it does not)."""
        self._pending.clear()
        self._answers.clear()
        self._finalizer()
