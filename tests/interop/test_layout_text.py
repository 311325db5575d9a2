"""nereus.interop without processes: gathered DTensor specs → one layout → `.nir` text,
whose boxes are what DTensor gives each rank; placements_for on the bundled plans."""

import pytest
import torch

import nereus.ir as ir
from nereus.interop import InteropError, placements_for
from nereus.interop.layouts import merge, rank_boxes
from nereus.interop.nir import Machine, module_text
from nereus.ir.mesh import mesh_boxes
from nereus.ir.model import DimPlacement as P

R, S0, S1, ST = P("replicate"), P("shard", 0), P("shard", 1), P("strided", 0, 2)
MACHINE = Machine(nodes=1, gpus_per_node=4, mem_bytes=16 << 30, host_mem_bytes=64 << 30)


def _fsdp2_tp2_gathered():
    """What 4 ranks of FSDP2 dp 2 x TP 2 (mesh [[0, 1], [2, 3]]) report: the column
    weight on the 2-D mesh, the norm on each rank's dp column (a 1-D sub-mesh)."""
    out = []
    for rank in range(4):
        column = ("q.weight", "param", (16, 8), "bf16", ("exp_avg",), ((0, 1, 2, 3), (2, 2), ("dp", "tp"), (ST, S0),
                                                                        (rank // 2, rank % 2)))
        row = ("o.weight", "param", (8, 16), "bf16", ("exp_avg",), ((0, 1, 2, 3), (2, 2), ("dp", "tp"), (S0, S1),
                                                                     (rank // 2, rank % 2)))
        column_ranks = (rank % 2, rank % 2 + 2)
        norm = ("norm.weight", "param", (10,), "bf16", ("exp_avg",), (column_ranks, (2,), ("dp",), (S0,),
                                                                       (rank // 2,)))
        out.append([column, row, norm])
    return out


def test_gathered_specs_become_one_layout_whose_text_gives_the_same_boxes():
    layout = merge(_fsdp2_tp2_gathered(), 4)
    by = layout.by_name()
    assert by["norm.weight"].dims == (("rep", 2), ("dp", 2)) and by["norm.weight"].gpus == (0, 2, 1, 3)
    text = module_text({"A": layout}, MACHINE)
    module = ir.parse_source(text, "<t>")
    placement = module.plan("A").placement("module.training")
    # the norm is written on the placement's (dp, tp) mesh: shard(0), replicate
    assert '"norm.weight"  shard(0)       replicate' in text or '"norm.weight"  shard(0)  replicate' in text
    for t in layout.tensors:
        for rank in range(4):
            assert mesh_boxes(t.name, t.shape, placement, rank) == rank_boxes(t, rank), (t.name, rank)
    # rows of the [16, 8] column weight: torch's _StridedShard docstring order
    assert [rank_boxes(by["q.weight"], r)[0][0] for r in range(4)] == [(0, 4), (8, 12), (4, 8), (12, 16)]
    # uneven: 10 norm rows over dp 2 are 5 and 5; over 4 ranks of another mesh 3, 3, 3, 1
    assert [rank_boxes(by["norm.weight"], r)[0][0] for r in range(4)] == [(0, 5), (0, 5), (5, 10), (5, 10)]


def test_ranks_that_disagree_are_refused_naming_the_tensor():
    gathered = _fsdp2_tp2_gathered()
    name, kind, shape, dtype, states, spec = gathered[3][0]
    gathered[3][0] = (name, kind, (32, 8), dtype, states, spec)
    with pytest.raises(InteropError) as caught:
        merge(gathered, 4)
    assert caught.value.format() == ("error: ranks disagree on q.weight of the module: param [16, 8] bf16 with "
                                     "exp_avg on one, param [32, 8] bf16 with exp_avg on rank 3")


def test_placements_that_differ_between_sub_meshes_are_refused():
    gathered = _fsdp2_tp2_gathered()
    name, kind, shape, dtype, states, (ranks, mesh, names, placements, coord) = gathered[1][2]
    gathered[1][2] = (name, kind, shape, dtype, states, (ranks, mesh, names, (R,), coord))
    with pytest.raises(InteropError, match="norm.weight is split differently on different ranks"):
        merge(gathered, 4)


def test_placements_for_a_bundled_plan():
    spec = placements_for("examples/ppo-8b.nir", "S2", "actor.training")
    assert spec.mesh_dim_names == ("dp", "tp") and spec.mesh_shape == (16, 2)
    shard0, shard1 = spec.placements["model.layers.0.self_attn.k_proj.weight"], \
        spec.placements["model.layers.0.mlp.down_proj.weight"]
    assert [str(p) for p in shard0] == ["R", "S(0)"] and [str(p) for p in shard1] == ["R", "S(1)"]
    assert spec.tp_plan["model.layers.3.mlp.down_proj"] == "rowwise"
    assert spec.stage_ranks[0][1] == (4, 5)  # replica 1, stage 0: GPUs 4 and 5 (pp 2)


def test_placements_for_zero3_is_fsdp2_over_tp():
    module = ir.parse_file("examples/ppo-8b.nir")
    text = ir.print_module(module).replace("actor.training    dp 16 tp 2 pp 2  on 0..63",
                                           "actor.training    dp 32 tp 2  on 0..63  zero 3")
    spec = placements_for(ir.parse_source(text, "x.nir"), "S2", "actor.training")
    assert [str(p) for p in spec.placements["model.layers.0.self_attn.q_proj.weight"]] == ["_S(0, 2)", "S(0)"]
    assert [str(p) for p in spec.placements["model.layers.0.self_attn.o_proj.weight"]] == ["S(0)", "S(1)"]


def test_placements_for_refuses_replicated_kv_heads():
    text = open("examples/ppo-8b.nir").read()
    module = ir.parse_source(text.replace("actor.training    dp 16 tp 2 pp 2  on 0..63",
                                          "actor.training    dp 4 tp 16  on 0..63"), "x.nir")
    with pytest.raises(InteropError) as caught:
        placements_for(module, "S2", "actor.training")
    assert caught.value.message.startswith("model.layers.0.self_attn.k_proj.weight: the plan gives TP rank 0 rows 0..128,")
    assert "tp > kv_heads" in caught.value.hint


def test_placements_for_unknown_plan():
    with pytest.raises(InteropError, match="plan S9 has no placement of actor.training"):
        placements_for("examples/ppo-8b.nir", "S9", "actor.training")


def test_optimizer_state_in_another_dtype_is_refused():
    from nereus.interop.layouts import _optimizer_states

    param = torch.nn.Parameter(torch.zeros(4, 2, dtype=torch.bfloat16))
    optim = torch.optim.AdamW([param])
    optim.state[param] = {"step": torch.tensor(1.0), "exp_avg": torch.zeros(4, 2)}
    with pytest.raises(InteropError, match="optimizer state 'exp_avg' of w is torch.float32, its parameter "
                                           "torch.bfloat16"):
        _optimizer_states(optim, param, "w", 0)
