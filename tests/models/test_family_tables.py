"""The families' tables drive the compiler unchanged: a q/k/v bias shards with its
weight's rows, q/k norms are whole on every TP rank, a tied head has no tensor; every
replica covers every tensor; transitions between plans verify."""

import itertools

import pytest

import nereus.ir as ir
from nereus.backends.json_program import program_json
from nereus.models import REPLICATED, parameter_count, tensor_table
from nereus.passes import compile_transition
from nereus.passes.layout import WITH_OPTIMIZER, box_volume, gpu_shards, shard_bytes, tensor_entries, tp_boxes
from nereus.passes.verify import verify_program

SIZES = dict(layers=3, hidden=64, heads=8, kv_heads=2, ffn=96, vocab=128, dtype="bf16")
QWEN2 = ir.Model("actor", "qwen2", qkv_bias=True, **SIZES)
QWEN3 = ir.Model("actor", "qwen3", qk_norm=True, head_dim=32, **SIZES)
TIED = ir.Model("actor", "llama", tie_embeddings=True, **SIZES)


def _spec(model, name):
    return next(spec for spec in tensor_table(model) if spec.name == name)


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_bias_boxes_are_the_weight_rows(tp):
    weight, bias = _spec(QWEN2, "layers.0.attn.qkv.weight"), _spec(QWEN2, "layers.0.attn.qkv.bias")
    assert bias.shape == (weight.shape[0],) and bias.parts == weight.parts
    for rank in range(tp):  # tp 4, 8 > kv_heads 2: KV rows replicated, bias rows with them
        assert [box[:1] for box in tp_boxes(weight, tp, rank)] == list(tp_boxes(bias, tp, rank))


def test_qk_norms_replicated_and_head_dim_sizes_q_and_o():
    for name in ("layers.1.attn.q_norm.weight", "layers.1.attn.k_norm.weight"):
        spec = _spec(QWEN3, name)
        assert (spec.shape, spec.sharding) == ((32,), REPLICATED)
        assert tp_boxes(spec, 8, 5) == (((0, 32),),)
    assert _spec(QWEN3, "layers.0.attn.qkv.weight").shape == ((8 + 2 * 2) * 32, 64)
    assert _spec(QWEN3, "layers.0.attn.o.weight").shape == (64, 8 * 32)


def test_tied_head_has_no_tensor():
    names = {spec.name for spec in tensor_table(TIED)}
    assert "lm_head.weight" not in names and "embed.weight" in names
    untied = ir.Model("actor", "llama", **SIZES)
    assert parameter_count(untied) - parameter_count(TIED) == 128 * 64
    critic = ir.Model("critic", "llama", tie_embeddings=True, head="value", **SIZES)
    assert "value_head.weight" in {spec.name for spec in tensor_table(critic)}


def _place(stage, dp, tp, pp, gpus):
    return ir.Placement(ir.ModelStage.parse(stage), dp, tp, pp, tuple(gpus), ())


@pytest.mark.parametrize("model, tp, pp", [(m, tp, pp) for m in (QWEN2, QWEN3) for tp, pp in
                                           itertools.product([1, 2, 4, 8], [1, 3])] +
                         [(TIED, tp, 1) for tp in (1, 2, 4, 8)])
def test_every_replica_covers_every_tensor_exactly(model, tp, pp):
    placement = _place("actor.training", 1, tp, pp, range(tp * pp))
    shapes = {name: shape for name, shape, _ in tensor_entries(model, WITH_OPTIMIZER)}
    seen: dict[str, set] = {}
    elements = 0
    for p, t in itertools.product(range(pp), range(tp)):
        for name, boxes in gpu_shards(model, placement, p, t):
            seen.setdefault(name, set()).update(boxes)
            elements += sum(box_volume(b) * (4 if "#" in name else 2) for b in boxes)
    assert set(seen) == set(shapes)
    for name, boxes in seen.items():
        full = 1
        for n in shapes[name]:
            full *= n
        assert sum(box_volume(b) for b in boxes) == full, name
    assert elements == sum(shard_bytes(model, placement, p, t) for p, t in itertools.product(range(pp), range(tp)))


def _module(model: ir.Model) -> ir.Module:
    cluster = ir.Cluster("c", 1, 8, ir.GpuSpec(80 * 10**9, 1e14, 1e12), 1e11, 1e10, 10**12)
    workload = ir.Workload("w", 4, 8, 8, 1, (("training", ("actor",)),))
    pp = 1 if model.tie_embeddings else 3
    s1 = ir.Plan("S1", None, (), (_place("actor.training", 2, 4, 1, range(8)),))
    s2 = ir.Plan("S2", None, (), (_place("actor.training", 1, 2, pp, [7, 6, 5, 4, 3, 2][:2 * pp]),))
    s3 = ir.Plan("S3", None, (), (_place("actor.training", 1, 8, 1, range(8)),))
    return ir.Module(cluster, (model,), workload, (s1, s2, s3), ())


@pytest.mark.parametrize("model", [QWEN2, QWEN3, TIED], ids=["qwen2", "qwen3", "tied"])
def test_transitions_verify(model):
    module = _module(model)
    ir.validate_module(module)
    for source, target in (("S1", "S2"), ("S2", "S3"), ("S3", "S1")):
        report = verify_program(program_json(compile_transition(module, source, target)))
        assert report.rounds >= 1
