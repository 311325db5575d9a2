"""Rank programs stay byte-identical through compiler speed-ups (issue 19).

`golden/rank_programs.json` holds the SHA-256 of the canonical JSON of rank programs
(`rank_digest`) and of whole programs (`program_json`), written by the compiler before
the dag / fusion / rank-lowering speed-ups; the passes must reproduce them bit for bit.
Cases: ZeRO 1 / 3 re-partitions with DP, TP and PP changes (a 128-GPU cut-down of the
405B example), offloaded stages, a fusion bucket that splits transfers, the 1,024- and
4,096-GPU examples (three ranks each). Regenerate only when the program format is meant
to change: `python tests/passes/test_passes_rank_golden.py --write`. The `memory_model`
header field (issue 41) changed them once: the programs of the first four cases compiled
for the "cpu" model, without that field, still hash to the digests from before it
(V1_CASES: those entries are kept, never rewritten).
"""

import hashlib
import json
import pathlib
import sys

import pytest

from nereus.backends.json_program import program_json
from nereus.backends.rank_json import canonical_json, rank_digest, rank_program_json
from nereus.ir import parse_file, parse_source
from nereus.passes import compile_transition

ROOT = pathlib.Path(__file__).resolve().parents[2]
GOLDEN = pathlib.Path(__file__).with_name("golden") / "rank_programs.json"

ZERO_128 = """
cluster c128 { nodes 16 gpus_per_node 8 gpu { mem 141GB flops 989TFLOPS hbm 4.8TB/s }
  intra 900GB/s inter 50GB/s host_mem 2TB reserve 5% }
model actor = llama { layers 20 hidden 512 heads 8 kv_heads 4 ffn 1024 vocab 1024 dtype bf16 }
model ref = actor
model reward = llama { layers 20 hidden 512 heads 8 kv_heads 4 ffn 1024 vocab 1024 dtype bf16 head value }
workload grpo { batch 256 prompt 256 response 256 microbatch 1 recompute selective
  generation: actor  inference: actor, ref, reward  training: actor }
plan S1 {
  actor.generation dp 4 tp 8 pp 4 on 0..127
  actor.inference dp 4 tp 8 pp 4 on 0..127
  ref.inference dp 4 tp 8 pp 4 on 0..127 offload
  reward.inference dp 4 tp 8 pp 4 on 0..127 offload
  actor.training dp 2 tp 4 pp 16 on 0..127 zero 1
}
plan S2 = S1 {
  actor.generation dp 2 tp 8 pp 8 on 0..127
  actor.inference dp 2 tp 8 pp 8 on 0..127
  ref.inference dp 2 tp 8 pp 8 on 0..127 offload
  reward.inference dp 2 tp 8 pp 8 on 0..127 offload
  actor.training dp 4 tp 8 pp 4 on 0..127 zero 1
}
plan S3 = S2 {
  actor.training dp 8 tp 4 pp 4 on 127, 126..0 zero 3
}
transition S1 -> S2
transition S2 -> S3
transition S3 -> S1
"""

# (case name, module loader, transitions, ranks (None: all), pass options, whole program digest)
CASES = [
    ("grpo-zero-cpu", lambda: parse_file(ROOT / "examples/rl/grpo-zero-cpu.nir"),
     [("S1", "S2"), ("S2", "S3"), ("S3", "S4"), ("S4", "S1")], None, {}, True),
    ("zero-128", lambda: parse_source(ZERO_128, "<zero-128>"), [("S1", "S2"), ("S2", "S3"), ("S3", "S1")],
     (0, 5, 63, 64, 100, 127), {}, True),
    ("zero-128-bucket", lambda: parse_source(ZERO_128, "<zero-128>"), [("S1", "S2"), ("S2", "S3")],
     (0, 37, 127), {"bucket": 1 << 20}, True),
    ("ppo-8b", lambda: parse_file(ROOT / "examples/ppo-8b.nir"), None, (0, 3, 7), {}, True),
    ("grpo-70b-1024", lambda: parse_file(ROOT / "examples/grpo-70b-1024.nir"), None, (0, 515, 1023), {}, False),
    ("grpo-405b-4096", lambda: parse_file(ROOT / "examples/grpo-405b-4096.nir"), None, (0, 2051, 4095), {}, False),
]


# the cpu memory model's programs without their `memory_model` field are byte for byte
# the programs compiled before the field existed (their digests, kept from then)
V1_CASES = [(f"{c[0]} (cpu model, before memory_model)",) + c[1:4] + ({**c[4], "memory_model": "cpu"}, c[5])
            for c in CASES[:4]]


def _digests(name, load, transitions, ranks, options, whole) -> dict:
    module = load()
    pairs = transitions or [(t.source, t.target) for t in module.transitions]
    # a program compiled for the cpu model is compared as it was before the field
    bare = (lambda p: {k: v for k, v in p.items() if k != "memory_model"}) if options.get("memory_model") == "cpu" \
        else (lambda p: p)
    out = {}
    for source, target in pairs:
        compiled = compile_transition(module, source, target, **options)
        entry = {str(r): rank_digest(bare(rank_program_json(compiled, r, version=1)))
                 for r in (ranks if ranks is not None else range(module.cluster.num_gpus))}
        if whole:
            entry["whole"] = hashlib.sha256(canonical_json(bare(program_json(compiled, version=1))).encode()).hexdigest()
        out[f"{source}->{target}"] = entry
    return out


@pytest.mark.parametrize("case", CASES + V1_CASES, ids=[c[0] for c in CASES + V1_CASES])
def test_rank_programs_match_golden(case):
    golden = json.loads(GOLDEN.read_text())
    assert _digests(*case) == golden[case[0]]


if __name__ == "__main__" and sys.argv[1:] == ["--write"]:
    kept = json.loads(GOLDEN.read_text())  # the v1 cases are never rewritten: they are the old programs
    GOLDEN.write_text(json.dumps({**{c[0]: _digests(*c) for c in CASES}, **{c[0]: kept[c[0]] for c in V1_CASES}},
                                 indent=1, sort_keys=True) + "\n")


def test_a_deferred_message_is_its_merged_transfers():
    """Fusion defers merging a pair's transfers until `xfers` is read (rank programs read
    only their own): the deferred message equals, hashes and pickles as the eager one."""
    import pickle

    from nereus.passes.fusion import Message, coalesce, fuse

    module = parse_source(ZERO_128, "<zero-128>")
    compiled = compile_transition(module, "S1", "S2")
    state = compiled.state
    rounds = fuse(state.dag, state.schedule)
    messages = [m for rnd in rounds for m in rnd]
    deferred = [(k, m) for k, rnd in enumerate(rounds) for m in rnd if m._xfers is None]
    assert deferred, "the case has pairs with several transfers"
    for k, m in deferred[:50]:
        raw = [x for x in state.schedule.rounds[k].xfers
               if x.kind == "send" and (x.src_gpu, x.dst_gpu) == (m.src, m.dst)]
        eager = Message(m.src, m.dst, tuple(coalesce(state.dag, raw)), m.bytes)
        assert m == eager and hash(m) == hash(eager) and pickle.loads(pickle.dumps(m)) == eager
    with pytest.raises(AttributeError):
        messages[0].src = 3
