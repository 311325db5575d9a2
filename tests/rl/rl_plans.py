"""Small modules for the RL loop's tests, built in Python (no parser needed)."""

from nereus.ir.model import Cluster, GpuSpec, Model, ModelStage, Module, Placement, Plan, Workload

STAGES = (("generation", ("actor",)), ("inference", ("ref", "reward")), ("training", ("actor", "critic")))


def tiny_module(plans: dict, *, gpus: int = 4, batch: int = 8, prompt: int = 6, response: int = 4,
                algo: str = "ppo", layers: int = 2, hidden: int = 32, dtype: str = "fp32", kv_heads: int = 2,
                reward_model: bool = True) -> Module:
    """plans: {name: {model_stage: (dp, tp, gpus tuple[, pp[, offload]])}}; unspecified stages default
    to the first plan's entry. Without `reward_model` the workload has no reward.inference
    (the reward is the task's rule alone)."""
    arch = dict(layers=layers, hidden=hidden, heads=4, kv_heads=kv_heads, ffn=2 * hidden, vocab=16, dtype=dtype)
    models = (Model("actor", "llama", **arch), Model("critic", "llama", head="value", **arch),
              Model("ref", "llama", base="actor", **arch), Model("reward", "llama", head="value", base="critic", **arch))
    dropped = ({"critic"} if algo != "ppo" else set()) | ({"reward"} if not reward_model else set())
    stages = tuple((s, tuple(m for m in ms if m not in dropped)) for s, ms in STAGES)
    models = tuple(m for m in models if reward_model or m.name != "reward")
    workload = Workload("rl", batch, prompt, response, 1, stages)
    cluster = Cluster("cpu", 1, gpus, GpuSpec(1 << 30, 1e12, 1e11), 1e10, 1e9, 1 << 34)
    first = next(iter(plans.values()))
    built = []
    for name, entries in plans.items():
        placements = []
        for ms in workload.model_stages():
            dp, tp, ids, *rest = entries.get(str(ms), first[str(ms)])
            pp, offload = (rest + [1, False][len(rest):])[:2]
            placements.append(Placement(ms, dp, tp, pp, tuple(ids), (), offload))
        built.append(Plan(name, None, tuple(placements), tuple(placements)))
    return Module(cluster, models, workload, tuple(built), ())


def uniform(dp: int, tp: int, ids) -> dict:
    return {str(ModelStage(m, s)): (dp, tp, tuple(ids)) for s, ms in STAGES for m in ms}
