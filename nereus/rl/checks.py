"""What the RL loop needs from a module, checked without torch: the launcher (`nereus
train`) runs these before it starts any process, and every worker runs them again.

Input: a parsed Module, the algorithm and its batch split, the process count.
Output: nothing, or the first SemanticError, located at the workload or the placement
that causes it, with a hint. Invariant: a module that passes starts training on every
rank (the worker raises nothing these checks could have found).
"""

from __future__ import annotations

from nereus.ir.diagnostics import SemanticError
from nereus.ir.model import Module, Placement, key_loc

# Model-stages (names fixed by the loop) each algorithm computes with. reward.inference is
# optional: without it the reward is the task's rule alone (nereus.rl.reward), as in
# rule-based / verifiable-reward RL; with it the reward model's score is logged too.
REQUIRED = {"ppo": ("actor.generation", "ref.inference", "actor.training", "critic.training"),
            "grpo": ("actor.generation", "ref.inference", "actor.training")}
OPTIONAL = ("reward.inference",)
MINIBATCHES = 2  # updates per step (one epoch over the batch), RlConfig's default
TASK_TOKENS = 11  # the tasks' token ids: digits 0..9 and BOS 10 (nereus.rl.reward)
# The head each model of the loop computes with: log-probs need a vocab projection,
# values and reward-model scores a scalar head.
HEADS = {"actor": "lm", "ref": "lm", "critic": "value", "reward": "value"}


def check_stages(module: Module, algo: str) -> None:
    """Every model-stage the algorithm needs is declared."""
    stages = {str(ms) for ms in module.workload.model_stages()}
    missing = [ms for ms in REQUIRED[algo] if ms not in stages]
    if missing:
        raise SemanticError(f"the workload lacks {', '.join(missing)}, which {algo} needs", module.workload.loc,
                            hint="declare generation: actor, inference: ref (reward optional), "
                                 "training: actor" + (", critic" if algo == "ppo" else ""))


def check_batch(module: Module, algo: str, minibatches: int, group: int) -> None:
    """The batch splits into minibatches (of whole GRPO groups)."""
    batch = module.workload.batch
    unit = minibatches * (group if algo == "grpo" else 1)
    if group < 1 or minibatches < 1 or batch % unit:
        raise SemanticError(f"batch {batch} must divide into {minibatches} minibatches"
                            + (f" of whole groups of {group}" if algo == "grpo" else ""),
                            key_loc(module.workload, "batch"),
                            hint=f"use a batch that is a multiple of {unit}")


def check_placement(p: Placement, world: int) -> None:
    """The placement's GPUs are among the `world` processes (one per GPU id)."""
    if max(p.gpus) >= world:
        raise SemanticError(
            f"{p.model_stage} uses GPU {max(p.gpus)} but only {world} processes run",
            p.loc, hint=f"run with --nproc {max(p.gpus) + 1} or more")


def check_models(module: Module, text: bool = False) -> None:
    """The workload's models read the tasks' tokens (unless `text`: a tokenizer's, checked
    with it) and have the head the loop uses."""
    for name in sorted({ms.model for ms in module.workload.model_stages()}):
        model = module.model(name)
        if model.vocab < TASK_TOKENS and not text:
            where = f" (vocab_size of {model.checkpoint})" if model.checkpoint else ""
            raise SemanticError(f"{name} has vocab {model.vocab}{where} but the tasks use {TASK_TOKENS} tokens",
                                key_loc(model, "vocab"),
                                hint=f"use a model with a vocab of at least {TASK_TOKENS} (token ids 0..{TASK_TOKENS - 1})")
        wanted = HEADS.get(name)
        if wanted is not None and model.head != wanted:
            raise SemanticError(f"{name} needs `head {wanted}` in the RL loop, it has head {model.head}",
                                key_loc(model, "head"), hint="actor and ref: head lm; critic and reward: head value")
        if name == "reward" and model.checkpoint_dir is not None:
            names = checkpoint_names(model.checkpoint_dir)
            # a missing value head starts at zero: right for a critic (it learns), but the
            # reward model is never trained, so it would score every response 0
            if names is not None and "score.weight" not in names:
                raise SemanticError(f"reward reads {model.checkpoint}, which has no score.weight: its value head "
                                    "would start at zero and score every response 0", model.loc,
                                    hint="use a reward model's checkpoint (a ...ForSequenceClassification with "
                                         "num_labels=1), or leave reward.inference out (the task's rule scores)")


def checkpoint_names(directory: str):
    """The tensor names of a checkpoint directory (nereus.models.safetensors_header: its
    headers, no torch, no tensor data), or None where they cannot be read (the loader, and
    `nereus train`'s checkpoint check, say why)."""
    from nereus.ir.diagnostics import NereusError
    from nereus.models.safetensors_header import checkpoint_entries

    try:
        return set(checkpoint_entries(directory))
    except NereusError:
        return None


def check_replicas(module: Module, minibatches: int) -> None:
    """Every DP replica of every placement, and with expert parallelism every EP rank of
    it (they run the dense part data-parallel), gets at least one row of each minibatch
    (the loop splits rows unevenly when dp·ep does not divide them, but cannot run a shard
    on none: its pipeline would send empty messages)."""
    rows = module.workload.batch // minibatches
    for plan in module.plans:
        for p in plan.placements:
            if p.dp * p.ep > rows:
                what = f"dp {p.dp}" if p.ep == 1 else f"dp {p.dp} × ep {p.ep} data-parallel shards"
                raise SemanticError(f"plan {plan.name}: {p.model_stage} has {what} but a minibatch has {rows} rows",
                                    key_loc(p, "dp"), hint=f"use dp·ep <= {rows} or a batch of at least "
                                                           f"{p.dp * p.ep * minibatches}")


def check_run(module: Module, algo: str, minibatches: int, group: int, world: int, plans=None,
              text: bool = False) -> None:
    """Everything above, for every plan of the module (or of `plans`, the names a run uses:
    a resumed run may have fewer processes than other plans need). `text`: a text dataset
    (its tokenizer, not the tasks' tokens, bounds the vocab)."""
    check_stages(module, algo)
    check_models(module, text)
    check_batch(module, algo, minibatches, group)
    check_replicas(module, minibatches)
    for plan in (p for p in module.plans if plans is None or p.name in plans):
        for placement in plan.placements:
            check_placement(placement, world)
