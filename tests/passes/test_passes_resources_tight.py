"""resources on memory-tight GPUs: a transfer squeezed through less than one layer of
transient room takes many rounds; the schedule stays proven and its round count does not
grow, and a transfer that cannot move in a round is not re-cut in that round."""

from dataclasses import replace

import pytest

import nereus.passes.resources as resources
from builders import cluster, llama, module, place, workload
from nereus.backends.json_program import program_json
from nereus.passes import compile_transition
from nereus.passes.layout import shard_bytes
from nereus.passes.verify import verify_program


def tight_module(slack_layers: float, tp: int = 2, layers: int = 8):
    """actor.training moves from GPU 2 onto GPUs 0..tp-1 at tp; critic.training stays on
    GPU 0. GPUs hold the larger of the plans' states plus `slack_layers` layers of one
    actor layer: on GPU 0 the incoming shard has only that slack for its message buffers."""
    actor, critic = llama("actor", layers=layers), llama("critic", layers=layers, head="value")
    w = workload({"training": ["actor", "critic"]})
    plans = {"S": [place("actor.training", 1, 1, 1, [2]), place("critic.training", 1, 1, 1, [0])],
             "T": [place("actor.training", 1, tp, 1, list(range(tp))), place("critic.training", 1, 1, 1, [0])]}
    roomy = module(cluster(1, 4, 10**12), [actor, critic], w, plans)
    dag = compile_transition(roomy, "S", "T", check_fit=False, pipeline="diff,dag").dag
    need = max(max(dag.resident[g] + sum(a.shard_bytes for a in dag.allocs if a.gpu == g),
                   dag.resident[g] + sum(f.shard_bytes for f in dag.frees if f.gpu == g)) for g in range(4))
    layer = shard_bytes(actor, place("actor.training", 1, 1, 1, [0]), 0, 0) // (layers + 2)
    c = roomy.cluster
    mem = int((need + slack_layers * layer) / (1 - c.reserve)) + 1
    return replace(roomy, cluster=replace(c, gpu=replace(c.gpu, mem_bytes=mem)))


# rounds of the schedule before the scheduler skipped blocked transfers (the bound kept)
ROUNDS_BEFORE = {(0.01, 1): 1217, (0.05, 2): 110, (0.3, 2): 19, (1.5, 4): 4}


@pytest.mark.parametrize("slack,tp", sorted(ROUNDS_BEFORE))
def test_tight_transition_is_proven_moves_the_dag_bytes_and_keeps_its_rounds(slack, tp):
    m = tight_module(slack, tp)
    compiled = compile_transition(m, "S", "T", check_fit=False)
    report = verify_program(program_json(compiled), against=m)
    moved = sum(x.bytes for x in compiled.dag.xfers if x.kind != "keep")
    assert report.bytes_moved == moved  # chunking cuts transfers, never adds bytes
    assert report.rounds <= ROUNDS_BEFORE[(slack, tp)]
    assert report.worst_fraction <= 1.0


def test_a_transfer_that_cannot_move_is_not_cut_again_and_again():
    """Before: every blocked transfer was offered to `_fit` / `_split_slot` up to three times
    a round (reserve, whole slots, below a slot), 1,400 calls for 141 transfers here."""
    calls = {"n": 0}
    fit, split = resources._fit, resources._split_slot

    def counted(function):
        def wrapper(*args, **kwargs):
            calls["n"] += 1
            return function(*args, **kwargs)
        return wrapper

    dag = compile_transition(tight_module(0.05, 2), "S", "T", check_fit=False, pipeline="diff,dag").dag
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(resources, "_fit", counted(fit))
        patch.setattr(resources, "_split_slot", counted(split))
        lending, _ = resources._schedule(dag, range(len(dag.stages)), staging=True)  # one schedule's calls
    sent = sum(len(r.xfers) for r in lending.rounds)
    assert calls["n"] <= sent
