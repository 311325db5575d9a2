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
