"""resources: cycles on full GPUs are broken (host staging), edges are classified, the
independent per-model-stage baseline fails where coordination succeeds."""

import pytest

from builders import cluster, llama, module, offload_module, place, ring_module, workload
from nereus.ir.diagnostics import InfeasibleError, ProgramError
from nereus.passes import compile_transition
from nereus.backends.json_program import program_json
from nereus.passes.layout import shard_bytes
from nereus.passes.verify import verify_program


def compile_full(module, source, target, **options):
    """These tests size GPUs to the transition's state alone (the step's grads and
    activations would not fit): they test the scheduler, so the plan check is skipped."""
    return compile_transition(module, source, target, check_fit=False, **options)

NAMES = ["actor", "critic", "ref"]


def _ring(n: int, host_mem: int = 10**10, slack_layers: float = 1.5):
    return ring_module(n, host_mem, slack_layers)


@pytest.mark.parametrize("n", [2, 3])
def test_units_trading_places_on_full_gpus_compile_and_verify(n):
    m, unit = _ring(n)
    compiled = compile_full(m, "S", "T")
    verify_program(program_json(compiled))
    assert compiled.summary["bytes"]["staged"] >= unit
    assert any("host memory" in note for note in compiled.summary["notes"])


def test_cycle_without_host_memory_is_infeasible_naming_gpus_and_bytes():
    m, _ = _ring(2, host_mem=1000)
    with pytest.raises(InfeasibleError, match=r"GPU \d+ needs [0-9.]+ [KMGT]?i?B more"):
        compile_full(m, "S", "T")


def test_independent_baseline_fails_where_coordination_succeeds():
    m, _ = _ring(2)
    baseline = compile_full(m, "S", "T", independent=True)
    assert any("deadlock" in note for note in baseline.summary["notes"])
    with pytest.raises(ProgramError):
        verify_program(program_json(baseline))


def _handover():
    """actor.generation leaves GPU 0 for GPU 2; actor.training moves from GPU 1 into GPU 0,
    which only has room once generation is gone: one same-model cross-stage edge."""
    a = llama("actor", layers=16)
    train = shard_bytes(a, place("actor.training", 1, 1, 1, [0]), 0, 0)  # generation holds train / 7
    c = cluster(1, 4, train + train // 12)
    w = workload({"generation": ["actor"], "training": ["actor"]})
    return module(c, [a], w, {
        "S": [place("actor.generation", 1, 1, 1, [0]), place("actor.training", 1, 1, 1, [1])],
        "T": [place("actor.generation", 1, 1, 1, [2]), place("actor.training", 1, 1, 1, [0])],
    })


def test_resource_edges_are_added_and_classified():
    compiled = compile_full(_handover(), "S", "T")
    verify_program(program_json(compiled))
    edges = compiled.state.schedule.edges
    assert [e.kind for e in edges] == ["same-model-cross-stage"]
    assert edges[0].gpu == 0
    assert compiled.summary["rounds"] >= 2


def test_single_round_lowering_overflows_on_the_handover():
    compiled = compile_full(_handover(), "S", "T", pipeline="diff,dag,lower")
    with pytest.raises(ProgramError, match="capacity"):
        verify_program(program_json(compiled))


def test_offloaded_state_moves_in_host_memory():
    """ref.inference is offloaded: its before and after shards live in host memory, so GPUs
    that could not hold it still take the transition; flipping offload copies through."""
    m = offload_module()
    program = program_json(compile_full(m, "S", "T"))
    assert all(u["offload"] for u in program["units"]["after"])
    verify_program(program)
    flipped = compile_full(m, "S", "U")
    assert not flipped.summary["stages"]["ref.inference"]["unchanged"]
    verify_program(program_json(flipped))


def test_dag_view_with_resource_edges_is_acyclic():
    import networkx as nx

    from nereus.passes.dag import dag_graph

    compiled = compile_full(_handover(), "S", "T")
    graph = dag_graph(compiled.dag, compiled.state.schedule)
    assert nx.is_directed_acyclic_graph(graph)
    assert any(d.get("kind") == "same-model-cross-stage" for _, _, d in graph.edges(data=True))


def test_fit_cuts_the_embedding_slot_when_it_alone_is_too_big():
    from nereus.passes.fitting import _fit, xfer_slice

    compiled = compile_full(_handover(), "S", "T")
    x = next(x for x in compiled.dag.xfers if x.kind == "send" and x.slots[0] == 0)
    first = xfer_slice(compiled.dag, x, 0, 1).bytes
    assert _fit(compiled.dag, x, first - 1)[0] is None  # whole slots only by default
    head, tail = _fit(compiled.dag, x, first - 1, fine=True)
    assert head is not None and 0 < head.bytes <= first - 1 and tail is not None
