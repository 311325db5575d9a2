"""Test hooks that end a rank the hard way: NEREUS_KILL="RANK:WHERE:STEP" sends SIGKILL
to that rank's own process at a point of the run, so crash tests can check that
`--resume` loses nothing but the steps since the last checkpoint.

WHERE is `step` (inside step STEP, after its first actor update: the live state is half
updated), `transition` (inside the transition after step STEP, after its first round on
that rank) or `save` (while the checkpoint of step STEP is written: that rank's data is
on disk, the checkpoint is not complete). Unset: nothing happens. At `step` and
`transition` the trainer first lets the checkpoint in flight finish, so a test knows
which checkpoint is the last complete one (a real crash may also lose the save in flight).
"""

from __future__ import annotations

import os
import signal
from typing import Optional

from nereus.ir.diagnostics import SettingError

POINTS = ("step", "transition", "save")


def kill_spec() -> Optional[tuple[int, str, int]]:
    """(rank, where, step) from NEREUS_KILL, None when unset; a SettingError naming the
    variable for anything else."""
    text = os.environ.get("NEREUS_KILL", "").strip()
    if not text:
        return None
    parts = text.split(":")
    try:
        rank, where, step = int(parts[0]), parts[1], int(parts[2])
        if len(parts) != 3 or where not in POINTS or rank < 0 or step < 1:
            raise ValueError
    except (ValueError, IndexError):
        raise SettingError(f"NEREUS_KILL={text!r}: must be RANK:WHERE:STEP with WHERE one of {', '.join(POINTS)}",
                           hint="tests kill a rank there, e.g. 1:save:2 (rank 1 while step 2's checkpoint is "
                                "written)") from None
    return rank, where, step


def kill_here(where: str, step: int, rank: int, before=None) -> None:
    """SIGKILL this process if NEREUS_KILL names this point (no cleanup, no report);
    `before()` runs first."""
    spec = kill_spec()
    if spec is not None and spec == (rank, where, step):
        if before is not None:
            before()
        os.kill(os.getpid(), signal.SIGKILL)
