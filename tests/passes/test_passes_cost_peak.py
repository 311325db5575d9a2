"""The cost pass's per-message latency and the summary's peak memory of a transition."""

import json
import pathlib
import re

import pytest
from click.testing import CliRunner

import nereus.ir as ir
from nereus.backends.json_program import program_json
from nereus.cli import nereusc
from nereus.passes import compile_transition
from nereus.passes.cost import MESSAGE_LATENCY_S
from nereus.passes.verify import verify_program

EXAMPLES = pathlib.Path(__file__).resolve().parents[2] / "examples"
BUCKET = "diff,dag,resources,fusion{bucket=%s},lower,cost"


def _ppo():
    return ir.parse_file(str(EXAMPLES / "ppo-8b.nir"))


def test_a_smaller_bucket_sends_more_messages_and_costs_more():
    module = _ppo()
    fused = compile_transition(module, "S1", "S2")
    split = compile_transition(module, "S1", "S2", pipeline=BUCKET % "16MiB")
    assert split.cost.messages > 10 * fused.cost.messages
    assert split.cost.bytes_total == fused.cost.bytes_total
    assert split.cost.seconds > fused.cost.seconds
    # without the latency term only bandwidth counts, and the bytes per link are the same
    no_latency = "diff,dag,resources,fusion%s,lower,cost{message_latency_s=0}"
    a = compile_transition(module, "S1", "S2", pipeline=no_latency % "")
    b = compile_transition(module, "S1", "S2", pipeline=no_latency % "{bucket=16MiB}")
    assert a.cost.seconds == pytest.approx(b.cost.seconds)
    assert fused.cost.seconds - a.cost.seconds >= MESSAGE_LATENCY_S * len(fused.program.messages) - 1e-12


def test_the_cost_pass_defaults_to_the_documented_latency():
    from nereus.passes.manager import CostPass

    assert CostPass().message_latency_s == MESSAGE_LATENCY_S


def _cases():
    """Small transitions (the 8B/70B examples take minutes to verify on a 2-core box): the
    CPU examples, units trading places on full GPUs (host staging), a cross-stage handover,
    offloaded state."""
    from builders import fig5_module
    from test_passes_resources import _handover, _ring

    for path in sorted((EXAMPLES / "rl").glob("*.nir")):
        module = ir.parse_file(str(path))
        for t in module.transitions:
            yield pytest.param(lambda m=module: m, t.source, t.target, id=f"{path.name}:{t.source}:{t.target}")
    yield pytest.param(lambda: _ring(2)[0], "S", "T", id="ring-2-staged")
    yield pytest.param(lambda: _ring(3)[0], "S", "T", id="ring-3-staged")
    yield pytest.param(_handover, "S", "T", id="handover")
    yield pytest.param(fig5_module, "S1", "tp_up", id="fig5")


@pytest.mark.parametrize("build,source,target", list(_cases()))
def test_summary_peak_is_the_verifiers_peak(build, source, target):
    # the staged rings size GPUs to the moved state alone, which `check` calls full
    compiled = compile_transition(build(), source, target, check_fit=False)
    peak = compiled.summary["peak_memory"]
    report = verify_program(program_json(compiled))
    assert peak["bytes"] == max(report.peak_bytes.values())
    assert report.peak_bytes[peak["gpu"]] == peak["bytes"]
    assert peak["headroom_bytes"] == peak["capacity_bytes"] - peak["bytes"]
    mem = compiled.state.module.cluster.gpu.mem_bytes
    assert peak["warning"] == (peak["bytes"] > int(mem * 0.95)) and peak["free_bytes"] == mem - peak["bytes"]


def _summary(*args):
    path = str(EXAMPLES / "ppo-8b.nir")
    result = CliRunner().invoke(nereusc, [path, "--transition", "S1:S2", "--emit", "summary", *args])
    assert result.exit_code == 0, result.output
    return result.output


def test_summary_prints_the_peak_and_what_it_leaves_of_the_gpu():
    path = str(EXAMPLES / "ppo-8b.nir")
    roomy = CliRunner().invoke(nereusc, [path, "--transition", "S2:S3", "--emit", "summary"])
    assert roomy.exit_code == 0, roomy.output
    assert ("  peak memory 87.6 GiB of 124.8 GiB usable (70.2%) on GPU 0 in round 0; headroom 37.1 GiB;"
            " 43.7 GiB of the GPU's 131.3 GiB free" in roomy.output.splitlines())
    assert "warning" not in roomy.output


def test_a_full_transition_warns_only_without_the_reserve_and_the_hint_removes_it():
    """S1 -> S2 fills the usable memory with transfer buffers (by design): with the example's
    `reserve 5%` that leaves 5% of every GPU free and nothing is wrong; without it the peak
    leaves 33 MiB and the warning names the reserve that removes it."""
    kept = json.loads(_summary("--json"))["transitions"][0]["peak_memory"]
    assert kept["fraction"] > 0.999 and kept["warning"] is False and kept["hint"] is None
    assert kept["free_bytes"] == kept["gpu_bytes"] - kept["bytes"] >= 0.05 * kept["gpu_bytes"]
    assert "warning" not in _summary()
    bare = json.loads(_summary("--json", "--set", "cluster.reserve=0"))["transitions"][0]["peak_memory"]
    assert bare["warning"] is True and bare["free_bytes"] < 0.05 * bare["gpu_bytes"]
    text = _summary("--set", "cluster.reserve=0")
    assert f"  warning: GPU {bare['gpu']} peaks with less than 5% of its memory free during this transition" in text
    assert "  hint: set `reserve 5%` in cluster h200 (now 0%)" in text and "both plans fit with it" in text
    # following the hint: the warning is gone, and the same for any reserve between
    followed = re.search(r"set `reserve ([0-9.]+%)`", bare["hint"]).group(1)
    assert "warning" not in _summary("--set", f"cluster.reserve={followed}")
    assert "warning" in _summary("--set", "cluster.reserve=3%")


def test_the_hint_says_when_a_plan_does_not_fit_with_the_reserve_it_needs():
    text = _summary("--set", "cluster.reserve=0", "--set", "cluster.gpu.mem=84GiB")
    assert "warning: GPU" in text
    assert ("hint: `reserve 5%` in cluster h200 would keep it free, but plan S2 does not fit with it (GPU 0 needs "
            "81.7 GiB in training, 79.8 GiB usable): `nereusc check") in text
    assert "--set cluster.reserve=5%` names placements of it that fit" in text
