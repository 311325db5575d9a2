"""reshard_module on the other transformers families Nereus supports, on 4 gloo ranks:
Qwen2 (q/k/v biases, split with their weights) moved FSDP2 dp 2 x TP 2 -> TP 2 x FSDP 2
and -> FSDP 4; Qwen3 (per-head q/k norms) and Qwen3-MoE (stacked expert tensors,
[experts, rows, cols]) moved FSDP 4 -> FSDP2's hybrid sharding (replicate 2 x shard 2) and
-> replicated. Bit-exact state and the next two losses equal. (Qwen3's q/k norms are plain
parameters that tensor parallelism leaves unsynchronised across its ranks unless they are
made replicated DTensors: a TP source would be inconsistent before any move.)"""

import pytest

FAMILIES = ("qwen2", "qwen3", "qwen3_moe")
PAIRS = {"qwen2": ("fsdp2_tp2", ("tp2_fsdp2", "fsdp4")), "qwen3": ("fsdp4", ("hsdp2x2", "replicated")),
         "qwen3_moe": ("fsdp4", ("hsdp2x2", "replicated"))}
CASES = [(family, target) for family in FAMILIES for target in PAIRS[family][1]]


def _run(rank, world):
    from interop_cases import run_moves

    out = {}
    for family in FAMILIES:
        source, targets = PAIRS[family]
        out.update({(family, target): found
                    for (_, target), found in run_moves(rank, [(source, targets)], family).items()})
    return out


@pytest.fixture(scope="module")
def results():
    from runtime_helpers import spawn_ok

    return spawn_ok(_run, 4)


@pytest.mark.multiprocess
@pytest.mark.parametrize("family,target", CASES, ids=[f"{f}-{t}" for f, t in CASES])
def test_family_moves_bit_exact(results, family, target):
    from interop_cases import check_move

    for found in results:
        check_move(found[(family, target)])
    names = results[0][(family, target)]["names"]
    special = {"qwen2": "self_attn.q_proj.bias", "qwen3": "self_attn.q_norm.weight",
               "qwen3_moe": "mlp.experts.gate_up_proj"}[family]
    assert any(special in n for n in names)
