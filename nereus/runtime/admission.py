"""Admission: the runtime runs only programs the verifier proves correct.

    verify_before_running(program, module) -> seconds    # or ProgramError

Called on rank 0 right after compilation, before the program is broadcast, so a program
that fails verification raises the same ProgramError on every rank and no rank executes a
byte of it. The proof is the one `nereusc verify --against FILE.nir` gives: the symbolic
replay plus the header re-derived from the module's plans. Cached with the program, per
(from, to). `Runtime(..., verify_programs=False)` skips it for programs verified ahead of
time; every rank's own checks of its part (nereus.runtime.part_check) still run.
"""

from __future__ import annotations

from nereus.backends.proof import verify_before_running

__all__ = ["verify_before_running"]
