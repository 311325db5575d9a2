"""Transitions between mesh layouts of `tensors` models, through the whole pipeline: the
program verifies (against the plans), sends exactly the owner-change bound (computed here
independently, by box arithmetic), and keeps a GPU's whole unchanged shards in place."""

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import nereus.ir as ir
from nereus.backends.json_program import program_json
from nereus.passes import compile_transition
from nereus.passes.verify import verify_program

CLUSTER = """cluster c {
  nodes 2
  gpus_per_node 2
  gpu { mem 16GB flops 100TFLOPS hbm 1TB/s }
  intra 100GB/s
  inter 10GB/s
  host_mem 64GB
}
"""
PLACEMENTS = ["replicate", "shard(0)", "shard(1)", "strided(0, 2)", "strided(0, 3)"]
MESHES = [("(world 4)", "0..3"), ("(dp 2, tp 2)", "0..3"), ("(tp 2, dp 2)", "0..3"), ("(dp 2, tp 2)", "3, 1, 2, 0"),
          ("(rep 1, dp 4)", "1, 3, 0, 2")]


def _placements(draw_rule, dims: int, shape) -> str:
    chosen = []
    for p in draw_rule:
        if p == "shard(1)" and len(shape) < 2:
            p = "shard(0)"
        chosen.append(p)
    return "  ".join(chosen[:dims])


@st.composite
def modules(draw):
    tensors = draw(st.lists(st.tuples(st.integers(1, 13), st.one_of(st.none(), st.integers(1, 7))), min_size=1,
                            max_size=4))
    states = draw(st.sampled_from(["", "  states: exp_avg\n"]))
    lines = [f'  tensor "t.{i}" [{a}{", " + str(b) if b else ""}]' for i, (a, b) in enumerate(tensors)]
    text = CLUSTER + "model m = tensors {\n  dtype fp32\n" + states + "\n".join(lines) + "\n}\n"
    text += "workload w { batch 1 prompt 1 response 1 microbatch 1  training: m }\n"
    for plan in ("A", "B"):
        mesh, gpus = draw(st.sampled_from(MESHES))
        dims = mesh.count(",") + 1
        rules = []
        for i, (a, b) in enumerate(tensors):
            picks = draw(st.lists(st.sampled_from(PLACEMENTS), min_size=dims, max_size=dims))
            # a shard may take several ranges of dim 0 only: stride dim 0 at most once, as the outer split
            if sum(p.startswith("strided") for p in picks) > 1 or any(p.startswith("strided") for p in picks[1:]):
                picks = [p.replace("strided(0, 2)", "shard(0)").replace("strided(0, 3)", "shard(0)") for p in picks]
            rules.append(f'    "t.{i}"  ' + _placements(picks, dims, (a, b) if b else (a,)))
        text += f"plan {plan} {{\n  m.training  mesh {mesh}  on {gpus} {{\n" + "\n".join(rules) + "\n  }\n}\n"
    return text


def _owner_change_bytes(module, source, target) -> int:
    """Bytes of every after shard that its GPU did not hold before (an oracle: boxes only)."""
    from nereus.passes.layout import gpu_shards

    model = module.model("m")
    before = module.plan(source).placement("m.training")
    after = module.plan(target).placement("m.training")
    held = {}
    for u, gpu in enumerate(before.gpus):
        for name, boxes in gpu_shards(model, before, 0, u, 0):
            held.setdefault((gpu, name), []).extend(boxes)
    total = 0
    for u, gpu in enumerate(after.gpus):
        for name, boxes in gpu_shards(model, after, 0, u, 0):
            for box in boxes:
                need = _volume(box) - sum(_overlap(box, other) for other in held.get((gpu, name), ()))
                total += need * 4
    return total


def _volume(box) -> int:
    n = 1
    for lo, hi in box:
        n *= hi - lo
    return n


def _overlap(a, b) -> int:
    n = 1
    for (x0, x1), (y0, y1) in zip(a, b):
        n *= max(0, min(x1, y1) - max(x0, y0))
    return n


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(modules())
def test_random_mesh_layouts_compile_to_proven_programs_at_the_bound(text):
    module = ir.parse_source(text, "t.nir")
    for source, target in (("A", "B"), ("B", "A")):
        compiled = compile_transition(module, source, target)
        verify_program(program_json(compiled), against=module)
        summary = compiled.summary
        if "bytes" not in summary:  # the same layout: nothing moves
            continue
        bound = _owner_change_bytes(module, source, target)
        assert summary["lower_bound_bytes"] == bound
        sent = summary["bytes"]["intra_node"] + summary["bytes"]["inter_node"]
        assert sent == bound, (sent, bound)


def test_unchanged_shards_stay_in_place():
    text = CLUSTER + """model m = tensors {
  dtype bf16
  tensor "a" [8, 4]
  tensor "b" [8, 4]
}
workload w { batch 1 prompt 1 response 1 microbatch 1  training: m }
plan A { m.training  mesh (dp 4)  on 0..3 { "a" shard(0)  "b" replicate } }
plan B { m.training  mesh (dp 4)  on 0..3 { "a" shard(0)  "b" shard(0) } }
"""
    module = ir.parse_source(text, "t.nir")
    summary = compile_transition(module, "A", "B").summary
    assert summary["bytes"]["kept"] == 8 * 4 * 2  # a's shards, whole on their GPU
    assert summary["bytes"]["intra_node"] + summary["bytes"]["inter_node"] == 0  # b's new shards are held locally
    assert summary["stages"]["m.training"]["primitives"] == ["repartition(m.training [0] -> [0])"]
