"""diff: EMU primitives on Figure-5-like cases."""

from builders import fig5_module, place
from nereus.passes.diff import diff_plans, diff_stage


def prims(target):
    stage = diff_plans(fig5_module(), "S1", target).stages[0]
    return [(p.kind, p.before, p.after) for p in stage.primitives], stage.kept


def test_extend_then_merge_raises_tp_at_constant_dp():
    got, kept = prims("tp_up")
    assert got == [("extend", (0, 1), ("+0", "+1")), ("merge", (0, 1), (0,)), ("merge", ("+0", "+1"), (1,))]
    assert kept == ()


def test_extend_adds_replicas_and_keeps_the_live_ones():
    got, kept = prims("extend")
    assert got == [("extend", (0, 1), (2, 3))]
    assert kept == ((0, 0), (1, 1))


def test_destroy_removes_replicas():
    got, kept = prims("destroy")
    assert got == [("destroy", (1,), ())]
    assert kept == ((0, 0),)


def test_split_shrinks_units():
    got, _ = prims("split")
    assert got == [("split", (0,), (0, 1)), ("split", (1,), (2, 3))]


def test_moved_replica_is_extend_plus_destroy():
    got, kept = prims("moved")
    assert got == [("extend", (0, 1), (1,)), ("destroy", (1,), ())]
    assert kept == ((0, 0),)


def test_unchanged_and_reordered():
    a = place("actor.training", 2, 2, 1, range(4))
    assert diff_stage(a, a).unchanged and diff_stage(a, a).primitives == ()
    b = place("actor.training", 2, 2, 1, [2, 3, 0, 1])  # replicas swap places: both kept
    d = diff_stage(a, b)
    assert not d.unchanged and d.kept == ((1, 0), (0, 1)) and d.primitives == ()


def test_unrelated_shapes_split_then_merge():
    d = diff_stage(place("actor.training", 1, 4, 1, range(4)), place("actor.training", 1, 2, 3, range(6)))
    assert [p.kind for p in d.primitives] == ["split", "merge"]


def test_extend_spreads_sources_over_live_replicas():
    from collections import Counter

    from builders import cluster, llama, module, workload
    from nereus.passes import compile_transition

    m = module(cluster(2, 4), [llama("actor")], workload({"generation": ["actor"]}), {
        "S": [place("actor.generation", 2, 1, 1, [0, 4])],
        "T": [place("actor.generation", 6, 1, 1, [0, 4, 1, 2, 5, 6])],
    })
    dag = compile_transition(m, "S", "T").dag
    load = Counter(x.src_gpu for x in dag.xfers if x.kind == "send")
    node_of = m.cluster.node_of
    assert all(node_of(x.src_gpu) == node_of(x.dst_gpu) for x in dag.xfers)  # same node preferred
    assert set(load) == {0, 4} and load[0] == load[4]  # both live replicas serve


def test_remote_extend_rotates_over_replicas():
    from collections import Counter

    from builders import cluster, llama, module, workload
    from nereus.passes import compile_transition

    m = module(cluster(2, 4), [llama("actor")], workload({"generation": ["actor"]}), {
        "S": [place("actor.generation", 2, 1, 1, [0, 1])],
        "T": [place("actor.generation", 6, 1, 1, [0, 1, 4, 5, 6, 7])],
    })
    dag = compile_transition(m, "S", "T").dag
    load = Counter(x.src_gpu for x in dag.xfers if x.kind == "send")
    assert load == Counter({0: load[0], 1: load[1]}) and abs(load[0] - load[1]) <= 1 and load[0] > 0
