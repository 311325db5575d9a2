"""`--emit dot`: every op node is connected by its dependency edges (data, round order,
resource edges by class, each styled apart), nodes clustered by round."""

import pathlib
import re

import pytest

import nereus.ir as ir
from nereus.backends.dot import EDGE_STYLES, program_dot
from nereus.passes import compile_transition

EXAMPLES = pathlib.Path(__file__).resolve().parents[2] / "examples"
NODE = re.compile(r"^\s+(\w+) \[label=")
EDGE = re.compile(r"^\s+(\w+) -> (\w+) \[(.*)\];$")


def _graph(text):
    nodes = [m.group(1) for m in map(NODE.match, text.splitlines()) if m]
    edges = [m.groups() for m in map(EDGE.match, text.splitlines()) if m]
    return nodes, edges


@pytest.fixture(scope="module")
def ppo_dot():
    compiled = compile_transition(ir.parse_file(str(EXAMPLES / "ppo-8b.nir")), "S1", "S2")
    return compiled, program_dot(compiled.program)


def test_no_isolated_node_in_a_bundled_example(ppo_dot):
    _, text = ppo_dot
    nodes, edges = _graph(text)
    assert len(nodes) > 30
    touched = {a for a, _, _ in edges} | {b for _, b, _ in edges}
    assert set(nodes) - touched == set()
    assert touched <= set(nodes)  # no edge to an undeclared node


def _styles(text):
    return {attrs.split(", label=")[0] for _, _, attrs in _graph(text)[1]}


def test_edges_of_every_class_are_styled_apart(ppo_dot):
    assert len(set(EDGE_STYLES.values())) == len(EDGE_STYLES)
    _, text = ppo_dot
    assert {EDGE_STYLES["data"], EDGE_STYLES["round"]} <= _styles(text)


@pytest.mark.parametrize("builder", ["_handover", "_ring"])
def test_resource_edges_and_staging_are_drawn(builder):
    import test_passes_resources as cases

    module = cases._handover() if builder == "_handover" else cases._ring(3)[0]
    compiled = compile_transition(module, "S", "T", check_fit=False)  # GPUs sized to the moved state
    text = program_dot(compiled.program)
    nodes, edges = _graph(text)
    assert set(nodes) == {a for a, _, _ in edges} | {b for _, b, _ in edges}
    kinds = {e.kind for e in compiled.state.schedule.edges}
    assert kinds and {EDGE_STYLES[k] for k in kinds} <= _styles(text)
    if builder == "_ring":  # staged shards: stage_out -> free of the same shard
        assert any(a.split("_")[1:3] == ["stage", "out"] and "_free_" in b for a, b, _ in edges)


def test_one_cluster_per_round_and_legible_size(ppo_dot):
    compiled, text = ppo_dot
    assert text.count("subgraph cluster_round") == compiled.program.num_rounds
    nodes, edges = _graph(text)
    assert len(nodes) < 200 and len(edges) < 600  # aggregated per (round, op kind, model-stage)
