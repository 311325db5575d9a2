"""fusion (same writes, fewer messages, bucket cap), cost (hand-computed), PassManager."""

import os

import re

import pytest

from builders import cluster, fig5_module, llama, module, place, workload
from nereus.passes import compile_transition
from nereus.backends.json_program import program_json
from nereus.passes.cost import MESSAGE_LATENCY_S
from nereus.passes.layout import shard_bytes
from nereus.passes.manager import PASSES, PipelineError, parse_pipeline
from nereus.passes.verify import verify_program

GOLDEN = os.path.join(os.path.dirname(__file__), "golden", "fig5_tp_up.txt")


def _writes(program):
    return sorted((s["tensor"], str(s["box"]), s["dst_unit"], op.get("dst", op.get("gpu")))
                  for rnd in program["rounds"] for op in rnd["ops"] if "segments" in op for s in op["segments"])


def _messages(program):
    return sum(op["op"] == "send" for rnd in program["rounds"] for op in rnd["ops"])


def test_fusion_keeps_writes_and_reduces_messages():
    m = fig5_module()
    fused = program_json(compile_transition(m, "S1", "tp_up"), version=1)
    plain = program_json(compile_transition(m, "S1", "tp_up", pipeline="diff,dag,resources,lower,cost"), version=1)
    verify_program(fused)
    verify_program(plain)
    assert _writes(fused) == _writes(plain)
    assert _messages(fused) < _messages(plain)
    pairs = [(op["src"], op["dst"]) for rnd in fused["rounds"] for op in rnd["ops"] if op["op"] == "send"]
    assert len(pairs) == len(set(pairs))  # one message per GPU pair per round


def test_bucket_caps_messages():
    m = fig5_module()
    bucket = 200_000
    compiled = compile_transition(m, "S1", "split", bucket=bucket)
    program = program_json(compiled, version=1)
    verify_program(program)
    for msgs in compiled.program.messages:
        for msg in msgs:
            assert msg.bytes <= bucket or all(x.slots[1] - x.slots[0] == 1 for x in msg.xfers)
    assert _writes(program) == _writes(program_json(compile_transition(m, "S1", "split"), version=1))


def _one_move(nodes, per_node, before, after):
    a = llama("actor")
    c = cluster(nodes, per_node, 10**9, intra=100e9, inter=10e9)
    w = workload({"generation": ["actor"]})
    n = len(before)
    m = module(c, [a], w, {"S": [place("actor.generation", n, 1, 1, before)],
                           "T": [place("actor.generation", n, 1, 1, after)]})
    return compile_transition(m, "S", "T").cost, shard_bytes(a, place("actor.generation", 1, 1, 1, [0]), 0, 0)


def test_cost_intra_node():
    cost, b = _one_move(1, 2, [0], [1])
    assert cost.bytes_intra == b and cost.bytes_inter == 0
    assert cost.seconds == pytest.approx(b / 100e9 + MESSAGE_LATENCY_S)  # one message


def test_cost_inter_node_shares_the_node_port():
    cost, b = _one_move(2, 2, [0, 1], [2, 3])
    assert cost.bytes_inter == 2 * b and cost.lower_bound == 2 * b
    # both GPUs of node 0 share one port: two messages through it
    assert cost.seconds == pytest.approx(2 * b / 10e9 + 2 * MESSAGE_LATENCY_S)


def test_registry_keys_equal_pass_names():
    for key, cls in PASSES.items():
        assert cls().name == key


def test_pipeline_parsing():
    passes = parse_pipeline("diff,dag,resources{independent=true},fusion{bucket=256MiB},lower")
    assert [p.name for p in passes] == ["diff", "dag", "resources", "fusion", "lower"]
    assert passes[2].independent is True and passes[3].bucket == 256 * 2**20
    with pytest.raises(PipelineError, match="unknown pass"):
        parse_pipeline("diff,dagg")
    with pytest.raises(PipelineError, match="no option"):
        parse_pipeline("fusion{size=1}")
    with pytest.raises(PipelineError, match="needs the result"):
        compile_transition(fig5_module(), "S1", "split", pipeline="dag")


@pytest.mark.parametrize("pipeline, message", [
    ("diff,dag,resources,fusion,lower,cost{host_bytes_per_s=0}", "host_bytes_per_s=0 of pass 'cost' must be a positive number"),
    ("diff,dag,resources,fusion,lower,cost{host_bytes_per_s=nan}", "host_bytes_per_s=nan of pass 'cost' must be a positive number"),
    ("diff,dag,resources,fusion,lower,cost{message_latency_s=-1}",
     "message_latency_s=-1 of pass 'cost' must be a number of seconds >= 0"),
    ("diff,dag,resources,fusion,lower,cost{message_latency_s=inf}",
     "message_latency_s=inf of pass 'cost' must be a number of seconds >= 0"),
    ("diff,dag,resources,fusion{bucket=0},lower", "bucket=0 of pass 'fusion' must be a positive size"),
    ("diff,dag,resources,fusion{bucket=-1},lower", "bucket=-1 of pass 'fusion' must be a positive size"),
    ("diff,dag,resources,fusion{bucket},lower", "option bucket of pass 'fusion' needs a value (bucket=256MiB)"),
])
def test_pass_options_out_of_range_are_refused(pipeline, message):
    """A zero host bandwidth divided by zero (a traceback); a negative or NaN latency made
    the estimate drop the transfers; a bucket of 0 or less cut every transfer apart."""
    with pytest.raises(PipelineError, match=re.escape(message)):
        parse_pipeline(pipeline)


def test_timings_and_summary():
    compiled = compile_transition(fig5_module(), "S1", "tp_up")
    assert set(compiled.timings) == set(PASSES)
    s = compiled.summary
    assert s["stages"]["actor.training"]["primitives"][0].startswith("extend")
    assert s["bytes"]["total"] == s["bytes"]["local"] + s["bytes"]["intra_node"] + s["bytes"]["inter_node"]


def test_golden_text_listing(request):
    from nereus.backends.text import program_text

    compiled = compile_transition(fig5_module(), "S1", "tp_up")
    text = program_text(compiled.program, compiled.summary)
    if os.environ.get("NEREUS_UPDATE_GOLDEN") == "1" or not os.path.exists(GOLDEN):
        os.makedirs(os.path.dirname(GOLDEN), exist_ok=True)
        with open(GOLDEN, "w") as handle:
            handle.write(text)
    with open(GOLDEN) as handle:
        assert text == handle.read()


def test_coalesce_joins_row_chunks_of_one_box():
    from dataclasses import replace

    from nereus.passes.dag import Piece
    from nereus.passes.fusion import coalesce

    compiled = compile_transition(fig5_module(), "S1", "moved")
    dag = compiled.dag
    x = next(x for x in dag.xfers if x.kind == "send" and x.pieces[0].box[0][1] - x.pieces[0].box[0][0] > 1)
    piece = x.pieces[0]
    (r0, r1), rest = piece.box[0], piece.box[1:]
    mid = (r0 + r1) // 2
    a = replace(x, pieces=(Piece(piece.spec, ((r0, mid),) + rest),), bytes=x.bytes // 2)
    b = replace(x, pieces=(Piece(piece.spec, ((mid, r1),) + rest),) + x.pieces[1:], bytes=x.bytes - x.bytes // 2)
    (joined,) = coalesce(dag, [b, a])
    assert sorted(joined.pieces, key=lambda p: (p.spec, p.box)) == sorted(x.pieces, key=lambda p: (p.spec, p.box))
    assert joined.bytes == x.bytes and joined.volumes == x.volumes


def test_cost_of_offloaded_state_is_bound_by_pcie():
    a = llama("ref")
    c = cluster(1, 2, 10**9, intra=100e9, inter=10e9)
    w = workload({"inference": ["ref"]})
    m = module(c, [a], w, {"S": [place("ref.inference", 1, 1, 1, [0], offload=True)],
                           "T": [place("ref.inference", 1, 1, 1, [1], offload=True)]})
    cost = compile_transition(m, "S", "T").cost
    b = shard_bytes(a, place("ref.inference", 1, 1, 1, [0]), 0, 0)
    assert cost.bytes_intra == b
    # host read and host write at 50 GB/s; NVLink at 100 GB/s plus one message's latency
    assert cost.seconds == pytest.approx(max(b / 50e9, b / 100e9 + MESSAGE_LATENCY_S))
