"""Settings a user can get wrong are errors naming them: environment variables (read when
the runtime's modules load, or by `nereus train`), the Runtime constructor's options and
WeightSync's stages and plans. Before, a depth of 0 failed every transition with an
IndexError, a word gave int()'s ValueError naming no variable, 'cpu' became the device
types ('c', 'p', 'u'), and an unknown plan was a bare KeyError."""

from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest

from nereus.ir.diagnostics import SettingError, env_number


@pytest.mark.parametrize("text, kind, minimum, message", [
    ("0", int, 1, "NEREUS_X='0': must be a whole number ≥ 1"),
    ("-3", int, 0, "NEREUS_X='-3': must be a whole number ≥ 0"),
    ("abc", int, 1, "NEREUS_X='abc': must be a whole number ≥ 1"),
    ("1.5", int, 1, "NEREUS_X='1.5': must be a whole number ≥ 1"),
    ("nan", float, 1.0, "NEREUS_X='nan': must be a finite number ≥ 1.0"),
    ("inf", float, 1.0, "NEREUS_X='inf': must be a finite number ≥ 1.0"),
])
def test_a_bad_value_names_the_variable(text, kind, minimum, message):
    with pytest.raises(SettingError) as raised:
        env_number("NEREUS_X", 7, minimum, kind, environ={"NEREUS_X": text})
    assert raised.value.message == message


def test_unset_or_empty_is_the_default_and_a_good_value_is_read():
    assert env_number("NEREUS_X", 7, 1, environ={}) == 7
    assert env_number("NEREUS_X", 7, 1, environ={"NEREUS_X": " "}) == 7
    assert env_number("NEREUS_X", 7, 1, environ={"NEREUS_X": "12"}) == 12
    assert math.isclose(env_number("NEREUS_X", 60.0, 1.0, float, environ={"NEREUS_X": "2.5"}), 2.5)


@pytest.mark.parametrize("name, value", [("NEREUS_P2P_DEPTH", "0"), ("NEREUS_P2P_CHUNK_BYTES", "x"),
                                         ("NEREUS_P2P_BATCH", "-1"), ("NEREUS_P2P_ALONE_BYTES", "-1")])
def test_the_runtime_refuses_them_when_it_loads(name, value):
    done = subprocess.run([sys.executable, "-c", "import nereus.runtime.rounds"], capture_output=True, text=True,
                          env={**os.environ, name: value})
    assert done.returncode != 0 and f"SettingError: error: {name}='{value}'" in done.stderr


def _runtime_options(rank, world):
    import nereus.ir as ir
    from nereus.ir import NereusError
    from nereus.runtime import Runtime
    from nereus.runtime.vllm_sync import WeightSync

    from test_transition_overhead import SOURCE

    module = ir.parse_source(SOURCE, "o.nir")
    out = {}
    for key, options in {"timeout": {"timeout_s": 0}, "timeout word": {"timeout_s": "abc"},
                         "direct": {"direct_min_bytes": "x"}, "groups": {"p2p_groups": 0},
                         "park": {"park_device_types": "cpu"}}.items():
        try:
            Runtime(module, "A", rank=rank, world_size=world, **options)
            out[key] = "accepted"
        except NereusError as error:
            out[key] = str(error).splitlines()[0]
    sync = WeightSync(module)
    for key, call in {"plan": lambda: sync.run("NOPE", {}),
                      "stages": lambda: WeightSync(module, source="actor.generation", target="actor.training")}.items():
        try:
            call()
            out[key] = "accepted"
        except NereusError as error:
            out[key] = str(error).splitlines()[0]
    return out


def test_runtime_and_weight_sync_options_are_checked():
    from runtime_helpers import spawn_ok

    for out in spawn_ok(_runtime_options, 2):
        assert out == {
            "timeout": "error: timeout_s=0: must be a number of seconds ≥ 1",
            "timeout word": "error: timeout_s='abc': must be a number of seconds ≥ 1",
            "direct": "error: direct_min_bytes='x': must be a whole number of bytes ≥ 0",
            "groups": "error: p2p_groups=0: must be a whole number ≥ 1 (or None: the default)",
            "park": "error: park_device_types='cpu': must be a tuple of device types",
            "plan": "error: unknown plan 'NOPE'",
            "stages": "error: WeightSync actor.generation -> actor.training: a sync copies one model's weights "
                      "into a stage without optimizer state",
        }


def test_nereus_fault_can_name_the_transition_it_fires_in(monkeypatch):
    """Under `nereus train` every step's weight sync is a transition too, so a fault for
    round 0 fired there, before any plan change: a fourth field names the transition."""
    from nereus.runtime.executor import _fault_spec

    monkeypatch.setenv("NEREUS_FAULT", "1:0:pack")
    assert _fault_spec(None, "sync.from", "sync.to") == (1, 0, "pack")
    monkeypatch.setenv("NEREUS_FAULT", "1:0:pack:S1->S2")
    assert _fault_spec(None, "sync.from", "sync.to") is None
    assert _fault_spec(None, "S1", "S2") == (1, 0, "pack")
    monkeypatch.setenv("NEREUS_FAULT", "1:0:pack:S1")
    with pytest.raises(SettingError, match=r"must be RANK:ROUND:PHASE\[:SOURCE->TARGET\]"):
        _fault_spec(None, "S1", "S2")
    monkeypatch.setenv("NEREUS_FAULT", "1:0:post:S2 -> S3")
    assert _fault_spec(None, "S2", "S3") == (1, 0, "post")


@pytest.mark.parametrize("edit", [
    lambda p: p.pop("rounds"),
    lambda p: p["rounds"][0]["ops"][0].pop("op"),
    lambda p: p.update(version=True),
    lambda p: p.update(version=1.0),
    lambda p: p["tensors"][0].update(dtype="int8"),
])
def test_rank_program_names_a_malformed_program(edit):
    """It raised KeyError, TypeError or ValueError from deep inside, and took version true
    or 1.0 for 1 (the verifier does not)."""
    import copy

    from nereus.backends.json_program import program_json
    from nereus.ir.diagnostics import ProgramError
    from nereus.passes import compile_transition
    from nereus.runtime.program import rank_program

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "passes"))
    from builders import fig5_module

    program = program_json(compile_transition(fig5_module(), "S1", "tp_up", check_fit=False))
    rank_program(program, 0)
    broken = copy.deepcopy(program)
    edit(broken)
    with pytest.raises(ProgramError):
        rank_program(broken, 0)


@pytest.mark.parametrize("text, value", [("", True), ("1", True), ("0", False), ("TRUE", True), ("off", False),
                                         (" no ", False)])
def test_a_switch_reads_the_usual_spellings(text, value):
    from nereus.ir.diagnostics import env_flag

    assert env_flag("NEREUS_X", True, environ={"NEREUS_X": text}) is value


@pytest.mark.parametrize("name, value", [("NEREUS_PAUSE_GC", "maybe"), ("NEREUS_COPIES_AFTER", "7"),
                                         ("NEREUS_P2P_IN_PLACE", "yes please")])
def test_a_switch_that_is_neither_is_refused_when_the_runtime_loads(name, value):
    """NEREUS_PAUSE_GC=maybe meant on and NEREUS_COPIES_AFTER=7 off, silently."""
    done = subprocess.run([sys.executable, "-c", "import nereus.runtime.executor"], capture_output=True, text=True,
                          env={**os.environ, name: value})
    assert done.returncode != 0 and f"SettingError: error: {name}='{value}': must be 1 or 0" in done.stderr


def _self_transition(rank, world):
    from nereus.runtime import Runtime
    import nereus.ir as ir

    from test_transition_overhead import SOURCE

    rt = Runtime(ir.parse_source(SOURCE, "o.nir"), "A", rank=rank, world_size=world)
    return len(rt.transition("A").rounds)


def test_a_transition_to_the_plan_the_runtime_is_in_is_an_empty_one():
    """The verifier's check of a plan-to-itself program belongs to `nereusc verify`: the
    runtime API returned an empty report for it and must go on doing so."""
    from runtime_helpers import spawn_ok

    assert spawn_ok(_self_transition, 2) == [0, 0]
