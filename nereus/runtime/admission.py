"""Admission: the runtime runs only programs the verifier proves correct.

    verify_before_running(program, module) -> seconds    # or ProgramError

Called on rank 0 right after compilation, before the program is broadcast, so a program
that fails verification raises the same ProgramError on every rank and no rank executes a
byte of it. The proof is the one `nereusc verify --against FILE.nir` gives: the symbolic
replay plus the header re-derived from the module's plans. Cached with the program, per
(from, to). `Runtime(..., verify_programs=False)` skips it for programs verified ahead of
time.
"""

from __future__ import annotations

import time

from nereus.ir.diagnostics import ProgramError
from nereus.ir.model import Module


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
