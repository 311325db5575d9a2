"""Rank programs (`nereusc FILE --transition S1->S2 --emit json --rank R`): one rank's part
of the program, lowered without emitting the whole, equal to the whole program filtered to
that rank; small and independent of the GPU count for a fixed per-rank shard."""

import dataclasses
import json
import sys
from collections import defaultdict

import pytest
from click.testing import CliRunner

sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[1] / "passes"))
from builders import cluster, llama, module, place, workload  # noqa: E402

from nereus.backends.json_program import program_json  # noqa: E402
from nereus.backends.rank_json import rank_digest, rank_digests, rank_program_json, split_by_rank  # noqa: E402
from nereus.cli import nereusc  # noqa: E402
from nereus.ir import parse_source  # noqa: E402
from nereus.ir.program import compact_segment_units, expand_segment_units  # noqa: E402
from nereus.passes import compile_transition  # noqa: E402


def rank_view(whole: dict, rank: int) -> dict:
    """The oracle: rank `rank`'s part cut out of the whole program's JSON (docs/program.md)."""
    rounds, touched, peers = [], defaultdict(lambda: defaultdict(set)), set()
    for rnd in whole["rounds"]:
        ops = []
        for index, op in enumerate(rnd["ops"]):
            if op["op"] == "send":
                if rank not in (op["src"], op["dst"]):
                    continue
                peers.add(op["dst"] if op["src"] == rank else op["src"])
                for seg in op["segments"]:
                    touched[("before", seg["src_unit"])][op["src"]].add(seg["tensor"])
                    touched[("after", seg["dst_unit"])][op["dst"]].add(seg["tensor"])
            elif op["gpu"] != rank:
                continue
            ops.append(dict(op, index=index))
        rounds.append({"ops": ops})
    units = {}
    for side, listing in whole["units"].items():
        units[side] = []
        for unit in listing:
            names = touched.get((side, unit["id"]), {})
            shards = [s for s in unit["shards"] if s["gpu"] == rank or s["tensor"] in names.get(s["gpu"], ())]
            if shards or rank in unit["gpus"]:
                units[side].append(dict(unit, shards=shards))
    used = {s["tensor"] for side in units.values() for u in side for s in u["shards"]}
    gpus = peers | {rank}
    return dict(whole, rank=rank, peers=sorted(peers), rounds=rounds, units=units,
                tensors=[t for t in whole["tensors"] if t["name"] in used],
                gpus=[g for g in whole["gpus"] if g["id"] in gpus],
                nodes=[n for n in whole["nodes"] if n["id"] in {g["node"] for g in whole["gpus"] if g["id"] in gpus}],
                resident_bytes={g: b for g, b in whole["resident_bytes"].items() if int(g) in gpus})


def _mixed_module(level: int = 1):
    actor, critic = llama("actor", 3, 64, 8, 2, 128, 256), llama("critic", 3, 64, 8, 2, 128, 256, head="value")
    w = workload({"generation": ["actor"], "training": ["actor", "critic"]})
    zero = lambda p: dataclasses.replace(p, zero=level)  # noqa: E731
    return module(cluster(2, 4, 10**9), [actor, critic], w, {
        "S": [place("actor.generation", 2, 4, 1, range(8)), zero(place("actor.training", 2, 2, 2, range(8))),
              place("critic.training", 1, 2, 2, [4, 5, 6, 7])],
        "T": [place("actor.generation", 4, 2, 1, [7, 6, 5, 4, 3, 2, 1, 0]),
              zero(place("actor.training", 4, 2, 1, range(8))), place("critic.training", 2, 2, 1, range(4))],
    })


@pytest.mark.parametrize("level", [1, 3])
def test_every_rank_program_is_the_whole_program_filtered_to_that_rank(level):
    compiled = compile_transition(_mixed_module(level), "S", "T")
    whole = program_json(compiled, version=1)
    sent = recv = 0
    for rank in range(8):
        mine = rank_program_json(compiled, rank, version=1)
        assert expand_segment_units(mine) == rank_view(whole, rank)
        for rnd in mine["rounds"]:
            for op in rnd["ops"]:
                if op["op"] == "send":
                    sent += op["bytes"] if op["src"] == rank else 0
                    recv += op["bytes"] if op["dst"] == rank else 0
    total = sum(op["bytes"] for rnd in whole["rounds"] for op in rnd["ops"] if op["op"] == "send")
    assert sent == recv == total > 0


def test_split_of_the_verified_whole_gives_each_rank_a_digest_of_its_own_part():
    from nereus.passes.verify import verify_program

    compiled = compile_transition(_mixed_module(), "S", "T")
    whole = program_json(compiled, version=1)
    verify_program(whole)  # the global proof, once, where the compile runs
    parts, digests = split_by_rank(whole), rank_digests(whole)
    assert sorted(parts) == list(range(8))
    for rank in range(8):
        mine = rank_program_json(compiled, rank, version=1)  # lowered alone on the rank
        assert parts[rank] == mine and digests[rank] == rank_digest(mine)
    tampered = rank_program_json(compiled, 2, version=1)
    op = next(op for rnd in tampered["rounds"] for op in rnd["ops"] if op["op"] == "send")
    op["segments"][0]["box"][0][1] -= 1
    assert rank_digest(tampered) != digests[2]


def test_the_runtime_reader_lowers_a_rank_program_as_it_lowers_the_whole():
    from nereus.runtime.program import rank_program

    compiled = compile_transition(_mixed_module(), "S", "T")
    whole = program_json(compiled, version=1)
    for rank in (0, 5):
        full, part = rank_program(whole, rank), rank_program(rank_program_json(compiled, rank, version=1), rank)
        assert (full.before, full.after, full.send_bytes, full.recv_bytes, full.copy_bytes, full.keep_bytes) == \
            (part.before, part.after, part.send_bytes, part.recv_bytes, part.copy_bytes, part.keep_bytes)
        for a, b in zip(full.rounds, part.rounds):
            assert (a.allocs, a.aliases, a.copies, a.frees, a.stage_outs) == (b.allocs, b.aliases, b.copies, b.frees,
                                                                              b.stage_outs)
            # the same messages and pieces; the tag is the op's `index` in the whole round
            assert [(m.peer, m.pieces, m.nbytes) for m in a.sends] == [(m.peer, m.pieces, m.nbytes) for m in b.sends]
            assert [(m.peer, m.pieces, m.nbytes) for m in a.recvs] == [(m.peer, m.pieces, m.nbytes) for m in b.recvs]


def _scaled(nodes: int) -> str:
    """The same per-rank shards on `nodes` nodes: the job doubles its dp (zero 1)."""
    gpus = nodes * 8
    return f"""
cluster c {{ nodes {nodes} gpus_per_node 8 gpu {{ mem 141GB flops 989TFLOPS hbm 4.8TB/s }} intra 900GB/s inter 50GB/s host_mem 2TB }}
model actor = llama {{ layers 8 hidden 512 heads 8 kv_heads 4 ffn 1024 vocab 1024 }}
workload w {{ batch 64 prompt 16 response 16 microbatch 1  training: actor }}
plan A {{ actor.training dp {gpus // 16} tp 4 pp 2 on 0..{gpus // 2 - 1} zero 1 }}
plan B {{ actor.training dp {gpus // 8} tp 4 pp 2 on 0..{gpus - 1} zero 1 }}
"""


def test_a_rank_program_does_not_grow_with_the_gpu_count():
    sizes = {}
    for nodes in (4, 16):
        compiled = compile_transition(parse_source(_scaled(nodes), "s.nir"), "A", "B")
        sizes[nodes] = max(len(json.dumps(rank_program_json(compiled, r, version=1), separators=(",", ":")))
                           for r in (0, nodes * 4 + 3, nodes * 8 - 1))
        whole = len(json.dumps(program_json(compiled, version=1), separators=(",", ":")))
        assert sizes[nodes] * nodes < whole
    assert sizes[16] <= sizes[4] * 1.2


def test_cli_emits_one_rank(tmp_path):
    path = tmp_path / "s.nir"
    path.write_text(_scaled(4))
    result = CliRunner().invoke(nereusc, [str(path), "--transition", "A->B", "--emit", "json", "--rank", "19"],
                                catch_exceptions=False)
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert data["rank"] == 19 and data["format"] == "nereus-program"
    assert all(op["gpu"] == 19 if op["op"] != "send" else 19 in (op["src"], op["dst"])
               for rnd in data["rounds"] for op in rnd["ops"])
    bad = CliRunner().invoke(nereusc, [str(path), "--transition", "A->B", "--emit", "json", "--rank", "32"])
    assert bad.exit_code == 2 and "rank 32 is not a GPU" in bad.output
    other = CliRunner().invoke(nereusc, [str(path), "--transition", "A->B", "--emit", "text", "--rank", "1"])
    assert other.exit_code == 2 and "--rank" in other.output


def test_rank_programs_of_ep_units_with_several_replicas():
    """ep 2 tp 2 with dp 2 (a replica spans pp·ep·tp GPUs), to dp 4 ep 1 zero 1: each rank's
    program is the whole one filtered to it."""
    from nereus.ir.model import Model

    moe = Model("actor", "qwen3_moe", 2, 64, 4, 2, 96, 128, "bf16", qk_norm=True, experts=4,
                experts_per_token=2, expert_ffn=32, norm_topk_prob=True)
    ep = dataclasses.replace(place("actor.training", 2, 2, 2, [3, 2, 1, 0, 7, 6, 5, 4]), pp=1, ep=2)
    zero = dataclasses.replace(place("actor.training", 4, 2, 1, range(8)), zero=1)
    m = module(cluster(2, 4, 10**9), [moe], workload({"training": ["actor"]}), {"S": [ep], "T": [zero]})
    compiled = compile_transition(m, "S", "T")
    whole = program_json(compiled, version=1)
    for rank in range(8):
        assert expand_segment_units(rank_program_json(compiled, rank, version=1)) == rank_view(whole, rank)


def test_rank_programs_state_shared_segment_units_once_per_op():
    """A fused op names its (src_unit, dst_unit) once when all its segments share it;
    expanding gives the whole program's ops back, and ops with mixed units stay as they are."""
    compiled = compile_transition(_mixed_module(), "S", "T")
    whole = program_json(compiled, version=1)
    part = rank_program_json(compiled, 0, version=1)
    compact = [op for rnd in part["rounds"] for op in rnd["ops"] if "src_unit" in op]
    assert compact and all("src_unit" not in s and "dst_unit" not in s for op in compact for s in op["segments"])
    assert len(json.dumps(part)) < len(json.dumps(expand_segment_units(part)))
    mixed = {"op": "send", "segments": [{"tensor": "a", "box": [[0, 1]], "src_unit": "x/0", "dst_unit": "y/0"},
                                        {"tensor": "b", "box": [[0, 1]], "src_unit": "x/1", "dst_unit": "y/0"}]}
    assert compact_segment_units(mixed) is mixed
    for rnd in whole["rounds"]:
        for op in rnd["ops"]:
            program = {"rounds": [{"ops": [compact_segment_units(op)]}]}
            assert expand_segment_units(program)["rounds"][0]["ops"][0] == op
