"""Build `Module`s programmatically (no parser needed): small clusters, tiny llamas, plans."""

from __future__ import annotations

from nereus.ir.model import (STAGES, Cluster, GpuSetItem, GpuSpec, Model, ModelStage, Module, Placement, Plan,
                             Transition, Workload)


def cluster(nodes: int = 2, gpus_per_node: int = 4, mem: int = 10**9, host_mem: int = 10**10,
            intra: float = 100e9, inter: float = 10e9) -> Cluster:
    return Cluster("test", nodes, gpus_per_node, GpuSpec(mem, 1e15, 1e12), intra, inter, host_mem)


def llama(name: str, layers: int = 4, hidden: int = 64, heads: int = 8, kv_heads: int = 2, ffn: int = 128,
          vocab: int = 256, head: str = "lm") -> Model:
    return Model(name, "llama", layers, hidden, heads, kv_heads, ffn, vocab, "bf16", head)


def place(model_stage: str, dp: int, tp: int, pp: int, gpus, offload: bool = False) -> Placement:
    gpus = tuple(gpus)
    assert len(gpus) == dp * tp * pp, (model_stage, dp, tp, pp, gpus)
    items = tuple(GpuSetItem("id", g, g) for g in gpus)
    return Placement(ModelStage.parse(model_stage), dp, tp, pp, gpus, items, offload)


def workload(stages: dict[str, list[str]]) -> Workload:
    return Workload("w", 8, 16, 16, 1, tuple((s, tuple(stages[s])) for s in STAGES if s in stages))


def module(cluster_: Cluster, models: list[Model], work: Workload, plans: dict[str, list[Placement]],
           transitions: list[tuple[str, str]] = ()) -> Module:
    order = [str(ms) for ms in work.model_stages()]
    built = []
    for name, placements in plans.items():
        by_name = {str(p.model_stage): p for p in placements}
        built.append(Plan(name, None, tuple(placements), tuple(by_name[n] for n in order)))
    return Module(cluster_, tuple(models), work, tuple(built), tuple(Transition(a, b) for a, b in transitions))


def fig5_module(mem: int = 10**9) -> Module:
    """actor (training) on 8 GPUs, S1 dp2 tp2 pp1 on 0..3 and several targets."""
    c = cluster(2, 4, mem)
    w = workload({"training": ["actor"]})
    a = llama("actor")
    return module(c, [a], w, {
        "S1": [place("actor.training", 2, 2, 1, range(4))],
        "tp_up": [place("actor.training", 2, 4, 1, range(8))],      # Extend then Merge
        "extend": [place("actor.training", 4, 2, 1, range(8))],     # Extend
        "destroy": [place("actor.training", 1, 2, 1, range(2))],    # Destroy
        "split": [place("actor.training", 4, 1, 1, range(4))],      # Split
        "moved": [place("actor.training", 2, 2, 1, [0, 1, 6, 7])],  # Extend + Destroy of replica 1
    })


RING_MODELS = ["actor", "critic", "ref"]


def ring_module(n: int, host_mem: int = 10**10, slack_layers: float = 1.5):
    """n single-GPU training units on GPUs 0..n-1, each moving to the next GPU; GPUs hold
    one unit plus `slack_layers` layers of transient buffer (a cycle: host staging).
    Returns (module with plans S and T, bytes of one unit)."""
    from nereus.passes.layout import shard_bytes

    models = [llama(name) for name in RING_MODELS[:n]]
    unit = shard_bytes(models[0], place("actor.training", 1, 1, 1, [0]), 0, 0)
    layer = unit // (models[0].layers + 2)
    c = cluster(1, 4, unit + int(slack_layers * layer), host_mem)
    w = workload({"training": RING_MODELS[:n]})
    before = [place(f"{name}.training", 1, 1, 1, [i]) for i, name in enumerate(RING_MODELS[:n])]
    after = [place(f"{name}.training", 1, 1, 1, [(i + 1) % n]) for i, name in enumerate(RING_MODELS[:n])]
    return module(c, models, w, {"S": before, "T": after}), unit


def offload_module() -> Module:
    """ref.inference offloaded (S, T) or not (U) beside an untouched actor.training on GPU 0;
    the GPUs have no room for a ref shard next to the actor."""
    from nereus.passes.layout import shard_bytes

    ref, actor = llama("ref"), llama("actor")
    unit = shard_bytes(ref, place("ref.inference", 1, 1, 1, [0]), 0, 0)
    train = shard_bytes(actor, place("actor.training", 1, 1, 1, [0]), 0, 0)
    c = cluster(1, 4, train + train // 7 + unit // 2)  # actor state + grads; no room for a ref shard
    w = workload({"inference": ["ref"], "training": ["actor"]})
    return module(c, [actor, ref], w, {
        "S": [place("ref.inference", 2, 1, 1, [0, 1], offload=True), place("actor.training", 1, 1, 1, [0])],
        "T": [place("ref.inference", 1, 2, 1, [1, 0], offload=True), place("actor.training", 1, 1, 1, [0])],
        "U": [place("ref.inference", 2, 1, 1, [2, 3]), place("actor.training", 1, 1, 1, [0])],
    })


def colocated_module() -> Module:
    """actor.generation, actor.training and critic.training all moving on 8 GPUs (A -> B)."""
    c = cluster(2, 4)
    w = workload({"generation": ["actor"], "training": ["actor", "critic"]})
    return module(c, [llama("actor"), llama("critic", head="value")], w, {
        "A": [place("actor.generation", 2, 4, 1, range(8)), place("actor.training", 2, 2, 2, range(8)),
              place("critic.training", 1, 2, 2, [4, 5, 6, 7])],
        "B": [place("actor.generation", 4, 2, 1, [7, 6, 5, 4, 3, 2, 1, 0]), place("actor.training", 1, 4, 2, range(8)),
              place("critic.training", 2, 2, 1, [0, 1, 2, 3])],
    })


def assert_moves_the_lower_bound(m: Module, source: str = "S", target: str = "T"):
    """Compile source -> target and verify the program: sends never move less than the
    bytes whose owner changes, and ours move exactly that; the verifier's replay moves what
    the summary says. Returns (compiled, report)."""
    from nereus.backends.json_program import program_json
    from nereus.passes import compile_transition
    from nereus.passes.verify import verify_program

    compiled = compile_transition(m, source, target)
    report = verify_program(program_json(compiled))
    summary = compiled.summary
    sent = summary["bytes"]["intra_node"] + summary["bytes"]["inter_node"]
    assert sent == summary["lower_bound_bytes"]
    assert report.bytes_moved == summary["bytes"]["total"]
    return compiled, report
