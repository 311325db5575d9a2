"""Errors of nereus.interop, and the agreement that makes every rank raise the same one.

An `InteropError` names the tensor (its FQN) and the rank that found the problem. A
collective call of the package checks locally, then `agree_or_raise` gathers every
rank's verdict: if any rank failed, every rank raises that rank's error (the lowest such
rank's), so no rank goes on into a collective the others left.
"""

from __future__ import annotations

from typing import Optional

import torch.distributed as dist

from nereus.ir.diagnostics import NereusError


class InteropError(NereusError):
    """A module, optimizer or call that nereus.interop cannot take, with the tensor's name."""

    def __init__(self, message: str, name: Optional[str] = None, rank: Optional[int] = None,
                 hint: Optional[str] = None):
        super().__init__(message, hint=hint)
        self.name = name
        self.rank = rank

    def __reduce__(self):
        return type(self), (self.message, self.name, self.rank, self.hint)


def verdict(error: Optional[InteropError]):
    """An error as it travels in a gather (None for none)."""
    return None if error is None else (error.message, error.name, error.rank, error.hint)


def agree_or_raise(error: Optional[InteropError], group=None) -> None:
    """Collective: raise on every rank the error of the lowest rank that has one."""
    verdicts: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(verdicts, verdict(error), group=group)
    raise_first(verdicts)


def raise_first(verdicts: list) -> None:
    """Raise the error of the lowest rank whose gathered verdict is one."""
    for rank, verdict in enumerate(verdicts):
        if verdict is not None:
            message, name, at, hint = verdict
            if at is None or at < 0:
                message, at = f"rank {rank}: {message}", rank
            raise InteropError(message, name, at, hint)
