"""A user's reward function on decoded text (`nereus train --reward module:function`).

    def reward(prompts: list[str], responses: list[str], **row) -> list[float]

`prompts` are the dataset's prompt values (text, or the chat messages as given), `responses`
the decoded responses (up to the end-of-sequence token, special tokens dropped), and each
other field of the dataset's rows comes as a keyword with one value per sample (e.g.
`answer=["5", "5", "7", ...]`); a function that wants some fields only takes `**row`.
It runs on rank 0 once per step on the whole batch; its rewards reach every rank.

A failure is the user's to fix, so it is reported as a NereusError that names the row:
the batch call raised (the function is then called row by row to find the first row that
raises), returned something other than one finite number per sample, or the file or
function cannot be imported.
"""

from __future__ import annotations

import importlib
import importlib.util
import math
import numbers
import os
import sys
from typing import Callable

from nereus.ir.diagnostics import NereusError

HINT = "def reward(prompts: list[str], responses: list[str], **row) -> list[float]"


def load_reward(spec: str) -> Callable:
    """`module:function` (importable from the working directory or sys.path) or
    `path/to/file.py:function` → the callable."""
    target, sep, name = spec.rpartition(":")
    if not sep or not target or not name:
        raise NereusError(f"--reward {spec!r}: write MODULE:FUNCTION or FILE.py:FUNCTION",
                          hint="e.g. --reward examples/rl/arith_reward.py:reward")
    if target.endswith(".py") or os.sep in target:
        if not os.path.isfile(target):
            raise NereusError(f"--reward {spec}: no such file {target}", hint=HINT)
        module_name = "nereus_reward_" + os.path.splitext(os.path.basename(target))[0]
        loader = importlib.util.spec_from_file_location(module_name, os.path.abspath(target))
        module = importlib.util.module_from_spec(loader)
        try:
            loader.loader.exec_module(module)
        except Exception as error:  # noqa: BLE001 - the user's file: say which and what
            raise NereusError(f"--reward {spec}: importing {target} raised {type(error).__name__}: {error}",
                              hint=HINT) from None
    else:
        if os.getcwd() not in sys.path:
            sys.path.insert(0, os.getcwd())
        try:
            module = importlib.import_module(target)
        except Exception as error:  # noqa: BLE001
            raise NereusError(f"--reward {spec}: cannot import {target} ({type(error).__name__}: {error})",
                              hint=HINT) from None
    function = getattr(module, name, None)
    if not callable(function):
        raise NereusError(f"--reward {spec}: {target} has no function {name!r}", hint=HINT)
    return function


def _describe(index: int, prompts: list, responses: list, fields: dict, step: int) -> str:
    extra = "".join(f", {k}={v[index]!r}" for k, v in fields.items())
    return f"step {step}, sample {index}: prompt {prompts[index]!r}, response {responses[index]!r}{extra}"


def call_reward(function: Callable, spec: str, prompts: list, responses: list, fields: dict, step: int) -> list[float]:
    """The function's rewards for one batch, checked: one finite number per sample."""
    try:
        values = function(prompts, responses, **fields)
    except Exception as error:  # noqa: BLE001 - find and name the row it fails on
        for index in range(len(prompts)):
            try:
                function(prompts[index:index + 1], responses[index:index + 1],
                         **{k: v[index:index + 1] for k, v in fields.items()})
            except Exception as row_error:  # noqa: BLE001
                raise NereusError(f"the reward function {spec} raised {type(row_error).__name__}: {row_error} "
                                  f"on {_describe(index, prompts, responses, fields, step)}", hint=HINT) from None
        raise NereusError(f"the reward function {spec} raised {type(error).__name__}: {error} on the batch of step "
                          f"{step} (on each row alone it did not)", hint=HINT) from None
    try:
        values = list(values)
    except TypeError:
        raise NereusError(f"the reward function {spec} returned {type(values).__name__}, not a list of floats "
                          f"(step {step})", hint=HINT) from None
    if len(values) != len(prompts):
        raise NereusError(f"the reward function {spec} returned {len(values)} rewards for {len(prompts)} samples "
                          f"(step {step})", hint=HINT)
    out = []
    for index, value in enumerate(values):
        if hasattr(value, "item") and getattr(value, "ndim", getattr(value, "dim", lambda: 0)) in (0, ()):
            value = value.item()  # a 0-d numpy or torch scalar
        if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(float(value)):
            raise NereusError(f"the reward function {spec} returned {value!r} on "
                              f"{_describe(index, prompts, responses, fields, step)}: not a finite number", hint=HINT)
        out.append(float(value))
    return out
