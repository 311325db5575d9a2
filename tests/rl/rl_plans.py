"""Small modules for the RL loop's tests, built in Python (no parser needed)."""

from nereus.ir.model import Cluster, GpuSpec, Model, ModelStage, Module, Placement, Plan, Workload

STAGES = (("generation", ("actor",)), ("inference", ("ref", "reward")), ("training", ("actor", "critic")))


def tiny_module(plans: dict, *, gpus: int = 4, batch: int = 8, prompt: int = 6, response: int = 4,
                algo: str = "ppo", layers: int = 2, hidden: int = 32) -> Module:
    """plans: {name: {model_stage: (dp, tp, gpus tuple[, pp])}}; unspecified stages default
    to the first plan's entry."""
    arch = dict(layers=layers, hidden=hidden, heads=4, kv_heads=2, ffn=2 * hidden, vocab=16, dtype="fp32")
    models = (Model("actor", "llama", **arch), Model("critic", "llama", head="value", **arch),
              Model("ref", "llama", base="actor", **arch), Model("reward", "llama", head="value", base="critic", **arch))
    stages = STAGES if algo == "ppo" else tuple((s, tuple(m for m in ms if m != "critic")) for s, ms in STAGES)
    workload = Workload("rl", batch, prompt, response, 1, stages)
    cluster = Cluster("cpu", 1, gpus, GpuSpec(1 << 30, 1e12, 1e11), 1e10, 1e9, 1 << 34)
    first = next(iter(plans.values()))
    built = []
    for name, entries in plans.items():
        placements = []
        for ms in workload.model_stages():
            dp, tp, ids, *pp = entries.get(str(ms), first[str(ms)])
            placements.append(Placement(ms, dp, tp, pp[0] if pp else 1, tuple(ids), ()))
        built.append(Plan(name, None, tuple(placements), tuple(placements)))
    return Module(cluster, models, workload, tuple(built), ())


def uniform(dp: int, tp: int, ids) -> dict:
    return {str(ModelStage(m, s)): (dp, tp, tuple(ids)) for s, ms in STAGES for m in ms}
