"""GPU set forms: ids, ranges (both directions), nodes, node ranges, node-local GPUs, lists."""

import pytest

import nereus.ir as ir
from nereus.ir.gpuset import format_gpu_set, items_for, resolve_gpu_set

CLUSTER = """cluster c { nodes 4 gpus_per_node 4 gpu { mem 80GB flops 1TFLOPS hbm 1TB/s }
  intra 1GB/s inter 1GB/s host_mem 1TB }
model m = llama { layers 4 hidden 64 heads 4 kv_heads 4 ffn 64 vocab 64 }
workload w { batch 16 prompt 1 response 1 microbatch 1 training: m }
"""


def _gpus(set_text: str, world: int) -> tuple[int, ...]:
    module = ir.parse_source(CLUSTER + f"plan p {{ m.training dp {world} on {set_text} }}\n")
    placement = module.plan("p").placement("m.training")
    assert format_gpu_set(placement.gpu_set) == set_text.replace(" ,", ",")  # kept as written
    return placement.gpus


@pytest.mark.parametrize("set_text,expected", [
    ("0..15", tuple(range(16))),
    ("0..3, 12..15", (0, 1, 2, 3, 12, 13, 14, 15)),
    ("3, 2, 1, 0", (3, 2, 1, 0)),
    ("7..4", (7, 6, 5, 4)),
    ("n2..n3", tuple(range(8, 16))),
    ("n3..n2", (12, 13, 14, 15, 8, 9, 10, 11)),
    ("n2", (8, 9, 10, 11)),
    ("n2:0..3", (8, 9, 10, 11)),
    ("n2:3..1", (11, 10, 9)),
    ("n2:5", None),
    ("n1:2", (6,)),
    ("n0, 15, n1:0..1, 9..8", (0, 1, 2, 3, 15, 4, 5, 9, 8)),
])
def test_forms(set_text, expected):
    if expected is None:
        with pytest.raises(ir.SemanticError, match="node n2 has no GPU 5"):
            _gpus(set_text, 1)
        return
    assert _gpus(set_text, len(expected)) == expected


def test_mesh_order_is_replica_pipeline_tp():
    module = ir.parse_source(CLUSTER + "plan p { m.training dp 2 tp 2 pp 2 on 7..0 }\n")
    placement = module.plan("p").placement("m.training")
    assert placement.gpus == (7, 6, 5, 4, 3, 2, 1, 0)
    assert placement.gpu_of(replica=1, pp_stage=0, tp_rank=1) == 2
    assert placement.replica_gpus(0) == (7, 6, 5, 4)


def test_resolve_rejects_duplicates_and_unknown_ids():
    module = ir.parse_source(CLUSTER + "plan p { m.training dp 1 on 0 }\n")
    items = (ir.GpuSetItem("range", 0, 3), ir.GpuSetItem("nodes", 0, 0))
    with pytest.raises(ir.SemanticError, match="GPU 0 appears twice in m.training"):
        resolve_gpu_set(items, module.cluster, "m.training")
    with pytest.raises(ir.SemanticError, match="GPU 16 does not exist"):
        resolve_gpu_set((ir.GpuSetItem("id", 16, 16),), module.cluster)
    with pytest.raises(ir.SemanticError, match="node n4 does not exist"):
        resolve_gpu_set((ir.GpuSetItem("node_gpus", 0, 0, 4),), module.cluster)


def test_items_for_compresses_ascending_runs():
    assert format_gpu_set(items_for([0, 1, 2, 3, 8, 5, 6])) == "0..3, 8, 5..6"
    assert items_for([]) == ()
