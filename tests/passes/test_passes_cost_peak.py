"""The cost pass's per-message latency and the summary's peak memory of a transition."""

import json
import pathlib

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
    assert peak["warning"] == (peak["fraction"] > 0.95)


def test_summary_prints_the_peak_and_warns_above_95_percent():
    path = str(EXAMPLES / "ppo-8b.nir")
    roomy = CliRunner().invoke(nereusc, [path, "--transition", "S2:S3", "--emit", "summary"])
    assert roomy.exit_code == 0, roomy.output
    assert ("  peak memory 87.6 GiB of 124.8 GiB usable (70.2%) on GPU 0 in round 0; headroom 37.1 GiB"
            in roomy.output.splitlines())
    assert "warning" not in roomy.output
    # S1 -> S2 fills GPUs up to their usable memory with transfer buffers (chunked transfers)
    tight = CliRunner().invoke(nereusc, [path, "--transition", "S1:S2", "--emit", "summary", "--json"])
    assert tight.exit_code == 0, tight.output
    peak = json.loads(tight.output)["transitions"][0]["peak_memory"]
    assert peak["fraction"] > 0.95 and peak["warning"] is True
    text = CliRunner().invoke(nereusc, [path, "--transition", "S1:S2", "--emit", "summary"]).output
    assert (f"  warning: GPU {peak['gpu']} peaks above 95% of its usable memory during this transition"
            in text)
