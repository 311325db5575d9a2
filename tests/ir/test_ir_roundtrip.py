"""parse(print(m)) == m: hand-written programs, the examples, and random valid modules."""

from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import nereus.ir as ir
from nereus.ir.gpuset import items_for
from nereus.ir.model import MOE_ARCHITECTURES, QUANT_FORMATS, ZERO_STAGES
from nereus.ir.validate import valid_tps, validate_module

EXAMPLES = sorted((Path(__file__).parents[2] / "examples").glob("*.nir"))

HAND_WRITTEN = [
    # the original design example, verbatim
    """
cluster h200 {
  nodes 8
  gpus_per_node 8
  gpu { mem 141GB  flops 989TFLOPS  hbm 4.8TB/s }
  intra 900GB/s          # GPU<->GPU inside a node
  inter 25GB/s           # per node, each direction
  host_mem 2TB
}

model actor  = llama { layers 32 hidden 4096 heads 32 kv_heads 8 ffn 14336 vocab 128256 dtype bf16 }
model critic = llama { layers 32 hidden 4096 heads 32 kv_heads 8 ffn 14336 vocab 128256 head value }
model ref    = actor         # same architecture, separate weights
model reward = critic

workload ppo {
  batch 512  prompt 1024  response 2048  microbatch 4
  generation: actor
  inference:  actor, ref, reward, critic
  training:   actor, critic
}

plan S1 {
  actor.generation  dp 16 tp 4       on 0..63
  actor.inference   dp 32 tp 2       on 0..63
  ref.inference     dp 32 tp 2       on 0..63  offload
  reward.inference  dp 32 tp 2       on 0..63  offload
  critic.inference  dp 32 tp 2       on 0..63
  actor.training    dp 8  tp 4 pp 2  on 0..63
  critic.training   dp 8  tp 4 pp 2  on 0..63
}

plan S2 = S1 {               # inherit S1, override some model-stages
  actor.training    dp 16 tp 2 pp 2  on 0..63
  critic.training   dp 4  tp 4 pp 2  on 0..31
}

transition S1 -> S2
""",
    # everything on one line, a stage left out, tp above kv_heads (KV heads replicated)
    "cluster one{nodes 1 gpus_per_node 8 gpu{mem 24GB flops 82.6TFLOPS hbm 1008GB/s}intra 64GB/s inter 12.5GB/s "
    "host_mem 256GiB}model m=llama{layers 2 hidden 64 heads 8 kv_heads 2 ffn 96 vocab 512}"
    "workload w{batch 4 prompt 8 response 8 microbatch 4 training: m}"
    "plan a{m.training dp 1 tp 8 on 7..0}plan b=a{m.training dp 2 tp 4 on n0:0..3,n0:4..7}transition a->b",
]


def _check_round_trip(module: ir.Module) -> None:
    text = ir.print_module(module)
    again = ir.parse_source(text, "<printed>")
    assert again == module
    for plan, plan_again in zip(module.plans, again.plans):
        for placement, placement_again in zip(plan.declared, plan_again.declared):
            assert placement_again.gpus == placement.gpus
            if placement.gpu_set:
                assert placement_again.gpu_set == placement.gpu_set
    assert ir.print_module(again) == text


@pytest.mark.parametrize("text", HAND_WRITTEN, ids=["design", "one-line"])
def test_hand_written_round_trip(text):
    _check_round_trip(ir.parse_source(text))


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_examples_round_trip(path):
    _check_round_trip(ir.parse_file(path))


def test_design_example_meaning():
    module = ir.parse_source(HAND_WRITTEN[0])
    s2 = module.plan("S2")
    assert s2.placement("critic.training").gpus == tuple(range(32))
    assert s2.placement("actor.inference") == module.plan("S1").placement("actor.inference")
    assert s2.placement("actor.training").gpu_of(replica=1, pp_stage=1, tp_rank=0) == 1 * 4 + 1 * 2 + 0
    assert module.model("reward").head == "value" and module.model("reward").base == "critic"
    assert module.cluster.gpu.hbm_bytes_per_s == 4.8e12 and module.cluster.gpu.mem_bytes == 141 * 10**9


def test_placement_built_by_code_prints_its_gpus():
    module = ir.parse_source(HAND_WRITTEN[1])
    plan = module.plan("a")
    placement = plan.declared[0]
    coded = ir.Placement(placement.model_stage, 2, 4, 1, (0, 1, 2, 3, 6, 7, 4, 5), ())
    changed = ir.Plan("a", None, (coded,), (coded,))
    module = ir.Module(module.cluster, module.models, module.workload, (changed, module.plans[1]), module.transitions)
    assert "on 0..3, 6..7, 4..5" in ir.print_module(module)
    _check_round_trip(module)


# ---------------------------------------------------------------- random valid modules

_RESERVED = {"llama"}  # keywords work as names (contextual lexer); only models cannot be "llama"
NAMES = st.one_of(st.sampled_from(["plan", "on", "model", "offload", "dp", "n1", "training", "cluster"]),
                 st.from_regex(r"[A-Za-z_][A-Za-z0-9_]{0,5}", fullmatch=True)).filter(lambda n: n not in _RESERVED)
POSITIVE_FLOAT = st.floats(min_value=1e-3, max_value=1e15, allow_nan=False, allow_infinity=False)  # the rate bound


@st.composite
def clusters(draw):
    return ir.Cluster(
        draw(NAMES), draw(st.integers(1, 4)), draw(st.sampled_from([1, 2, 4, 8])),
        ir.GpuSpec(draw(st.integers(1, 10**15)), draw(POSITIVE_FLOAT), draw(POSITIVE_FLOAT)),
        draw(POSITIVE_FLOAT), draw(POSITIVE_FLOAT), draw(st.integers(1, 2**45)),
        draw(st.one_of(st.just(0.0), st.floats(min_value=0.0, max_value=0.99))))


NUMBER = st.one_of(st.sampled_from([1e-5, 1e-6, 10000.0, 500000.0, 1e6, 8.0, 0.5]),
                   st.floats(min_value=1e-12, max_value=1e12, allow_nan=False, allow_infinity=False))
NUMERICS = ("rope_theta", "rope_scaling", "norm_eps", "head_dim", "tie_embeddings", "qkv_bias", "qk_norm")


@st.composite
def rope_scalings(draw):
    low = draw(NUMBER)
    return ir.RopeScaling("llama3", draw(NUMBER), low, low * draw(st.sampled_from([2.0, 4.0, 1.5])),
                          draw(st.integers(1, 2**17)))


@st.composite
def numerics(draw):
    """The numerics keys, each left at its default or drawn (head_dim: explicit or derived)."""
    out = {}
    if draw(st.booleans()):
        out["rope_theta"] = draw(NUMBER)
    if draw(st.booleans()):
        out["norm_eps"] = draw(NUMBER)
    if draw(st.booleans()):
        out["rope_scaling"] = draw(rope_scalings())
    if draw(st.booleans()):
        out["head_dim"] = draw(st.sampled_from([8, 16, 64, 128]))
    for key in ("tie_embeddings", "qkv_bias", "qk_norm"):
        if draw(st.booleans()):
            out[key] = draw(st.booleans())
    return out


@st.composite
def architectures(draw):
    heads = draw(st.sampled_from([1, 2, 4, 8]))
    kv = draw(st.sampled_from([d for d in (1, 2, 4, 8) if heads % d == 0]))
    return dict(layers=draw(st.integers(1, 8)), hidden=heads * draw(st.sampled_from([8, 16, 24])), heads=heads,
                kv_heads=kv, ffn=8 * draw(st.integers(1, 40)), vocab=8 * draw(st.integers(1, 300)),
                dtype=draw(st.sampled_from(sorted(ir.DTYPE_BYTES))), head=draw(st.sampled_from(ir.HEADS)),
                **draw(numerics()))


@st.composite
def model_lists(draw):
    names = draw(st.lists(NAMES, min_size=1, max_size=4, unique=True))
    models: list[ir.Model] = []
    for index, name in enumerate(names):
        if index == 0 or draw(st.booleans()):
            family = draw(st.sampled_from(sorted(ir.ARCHITECTURE_DEFAULTS)))
            fields = {**ir.ARCHITECTURE_DEFAULTS[family], **draw(architectures())}
            if family in MOE_ARCHITECTURES:
                experts = draw(st.integers(1, 16))
                fields.update(experts=experts, experts_per_token=draw(st.integers(1, experts)),
                              expert_ffn=8 * draw(st.integers(1, 40)))
            models.append(ir.Model(name=name, architecture=family, **fields))
            continue
        base = draw(st.sampled_from(models))
        fields = {k: getattr(base, k) for k in ("layers", "hidden", "heads", "kv_heads", "ffn", "vocab", "dtype", "head",
                                                "experts", "experts_per_token", "expert_ffn", "norm_topk_prob",
                                                *NUMERICS)}
        overridden = []
        if draw(st.booleans()):  # an alias that overrides some keys
            fresh = draw(architectures())
            overridden = draw(st.lists(st.sampled_from(sorted(fresh)), max_size=3, unique=True))
            for key in overridden:
                fields[key] = fresh[key]
            if fields["hidden"] % fields["heads"] or fields["heads"] % fields["kv_heads"] or \
                    fields["kv_heads"] > fields["heads"]:
                fields.update({k: fresh[k] for k in ("hidden", "heads", "kv_heads")})
        if base.head_dim * base.heads == base.hidden and "head_dim" not in overridden:
            fields["head_dim"] = None  # derived in the base: derived again from the alias's sizes
        models.append(ir.Model(name=name, architecture=base.architecture, base=base.name, **fields))
    return draw(st.permutations(models))  # aliases may come before their base


def _encode(gpus: list[int], per_node: int, plain: bool) -> tuple[ir.GpuSetItem, ...]:
    """Spell `gpus` with node, node-local, descending-range and single items."""
    if plain:
        return items_for(gpus)
    items, i = [], 0
    while i < len(gpus):
        g = gpus[i]
        node, local = divmod(g, per_node)
        whole = gpus[i:i + per_node] == list(range(node * per_node, node * per_node + per_node))
        if local == 0 and whole:
            items.append(ir.GpuSetItem("nodes", node, node))
            i += per_node
            continue
        j = i + 1
        while j < len(gpus) and gpus[j] == gpus[j - 1] - 1:
            j += 1
        if j - i >= 2:
            items.append(ir.GpuSetItem("range", g, gpus[j - 1]))
        else:
            items.append(ir.GpuSetItem("node_gpus", local, local, node))
        i = j
    return tuple(items)


@st.composite
def placements(draw, ms, model, cluster):
    total = cluster.num_gpus
    tp = draw(st.sampled_from([t for t in valid_tps(model) if t <= total]))
    tied = model.tie_embeddings and model.head == "lm"  # embed and head on one stage
    pp = 1 if tied else draw(st.integers(1, min(model.layers, total // tp)))
    eps = [e for e in range(1, model.experts + 1) if model.experts % e == 0 and e * tp * pp <= total] or [1]
    ep = draw(st.sampled_from(eps))
    dp = draw(st.integers(1, total // (tp * pp * ep)))
    gpus = draw(st.permutations(range(total)))[: dp * tp * pp * ep]
    items = _encode(list(gpus), cluster.gpus_per_node, draw(st.booleans()))
    # zero: training only, and not with ep > 1 (validation refuses both)
    zero = draw(st.sampled_from(ZERO_STAGES)) if ms.stage == "training" and ep == 1 else 0
    quant = draw(st.sampled_from((None,) + QUANT_FORMATS)) if ms.stage == "generation" else None  # generation only
    return ir.Placement(ms, dp, tp, pp, tuple(gpus), items, draw(st.booleans()), zero, ep=ep, quant=quant)


@st.composite
def modules(draw):
    cluster = draw(clusters())
    models = draw(model_lists())
    names = [m.name for m in models]
    stages = []
    for stage in ir.STAGES:
        chosen = draw(st.lists(st.sampled_from(names), max_size=len(names), unique=True))
        if chosen:
            stages.append((stage, tuple(chosen)))
    if not stages:
        stages = [("training", (names[0],))]
    batch = draw(st.integers(1, 1024))
    workload = ir.Workload(draw(NAMES), batch, draw(st.integers(1, 10**5)), draw(st.integers(1, 10**5)),
                           draw(st.sampled_from([d for d in range(1, batch + 1) if batch % d == 0])), tuple(stages), draw(st.sampled_from(["none", "selective", "full"])))
    by_name = {m.name: m for m in models}
    order = list(workload.model_stages())
    plans: list[ir.Plan] = []
    for plan_name in draw(st.lists(NAMES, min_size=1, max_size=3, unique=True)):
        base = draw(st.sampled_from(plans)) if plans and draw(st.booleans()) else None
        chosen = order if base is None else draw(st.lists(st.sampled_from(order), unique=True))
        declared = tuple(draw(placements(ms, by_name[ms.model], cluster)) for ms in draw(st.permutations(chosen)))
        own = {p.model_stage: p for p in declared}
        inherited = {p.model_stage: p for p in base.placements} if base else {}
        resolved = tuple(own.get(ms) or inherited[ms] for ms in order)
        plans.append(ir.Plan(plan_name, base.name if base else None, declared, resolved))
    pairs = [(a.name, b.name) for a in plans for b in plans if a.name != b.name]
    transitions = tuple(ir.Transition(a, b) for a, b in draw(st.lists(st.sampled_from(pairs), unique=True))) \
        if pairs else ()
    return ir.Module(cluster, tuple(models), workload, tuple(plans), transitions)


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(modules())
def test_random_modules_round_trip(module):
    validate_module(module)  # the generator makes valid modules only
    _check_round_trip(module)


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 2**62))
def test_sizes_round_trip(value):
    assert ir.units.parse_size(ir.format_size(value), "mem") == value if value else ir.format_size(value) == "0B"


@settings(max_examples=200, deadline=None)
@given(POSITIVE_FLOAT)
def test_rates_and_flops_round_trip(value):
    assert ir.units.parse_rate(ir.format_rate(value), "intra") == value
    assert ir.units.parse_flops(ir.format_flops(value), "flops") == value


def test_crlf_line_ends_and_byte_order_mark(tmp_path):
    unix = ir.parse_source(HAND_WRITTEN[0])
    assert ir.parse_source(HAND_WRITTEN[0].replace("\n", "\r\n")) == unix
    path = tmp_path / "bom.nir"
    path.write_bytes(b"\xef\xbb\xbf" + HAND_WRITTEN[0].replace("\n", "\r\n").encode())
    assert ir.parse_file(path) == unix
    crlf_error = HAND_WRITTEN[0].replace("\n", "\r\n").replace("dp 4  tp 4 pp 2", "dp 4  tp 3 pp 2")
    with pytest.raises(ir.SemanticError) as caught:
        ir.parse_source(crlf_error, "w.nir")
    assert caught.value.format().splitlines()[:3] == [
        "w.nir:35:30: error: tp 3 must divide heads (32) of critic",
        "   35 |   critic.training   dp 4  tp 3 pp 2  on 0..31",
        "      |                              ^"]
