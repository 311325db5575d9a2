"""The runtime honours `offload` (CPU, 2 gloo ranks; host and device are the same memory
here, so the bookkeeping is what is tested): the shards of a model-stage its plan flags
`offload` are kept in host memory (pinned only for a CUDA runtime) and count nothing against the
GPU, every other shard is on the runtime's device; a chain into, between and out of
offloaded layouts keeps every byte; `gather_state_dict` returns the reference; the device
bytes the runtime reports at rest equal the compiler's resident model and its transition
peak equals the verifier's replay of the same program."""

from __future__ import annotations

import pytest
import torch

import nereus.ir as ir
from nereus.backends.json_program import program_json
from nereus.passes import compile_transition
from nereus.passes.feasibility import resident_bytes_by_model_stage
from nereus.passes.verify import verify_program
from nereus.runtime import Runtime, TransitionAborted

from runtime_helpers import spawn
from test_runtime import _check, _reference, _same

pytestmark = pytest.mark.multiprocess

WORLD = 2
SOURCE = """
cluster cpu {
  nodes 1  gpus_per_node 2
  gpu { mem 64MB  flops 1TFLOPS  hbm 100GB/s }
  intra 10GB/s  inter 1GB/s  host_mem 1GB
}
model actor = llama { layers 2 hidden 64 heads 4 kv_heads 2 ffn 128 vocab 128 }
model ref = actor
workload grpo {
  batch 4  prompt 16  response 16  microbatch 1
  generation: actor
  inference:  ref
  training:   actor
}
plan A {
  actor.generation dp 2 tp 1 on 0, 1
  ref.inference    dp 1 tp 2 on 0, 1
  actor.training   dp 1 tp 2 on 0, 1
}
plan B {  # into offload: ref goes to host memory in a new layout, actor.generation too
  actor.generation dp 1 tp 2 on 1, 0  offload
  ref.inference    dp 2 tp 1 on 0, 1  offload
  actor.training   dp 1 tp 2 on 0, 1
}
plan C {  # host to host (a new layout, both still offloaded)
  actor.generation dp 1 tp 2 on 0, 1  offload
  ref.inference    dp 1 tp 2 on 1, 0  offload
  actor.training   dp 2 tp 1 on 0, 1
}
plan D {  # out of offload
  actor.generation dp 2 tp 1 on 1, 0
  ref.inference    dp 1 tp 1 pp 2 on 0, 1
  actor.training   dp 1 tp 2 on 1, 0
}
"""
STAGES = ("actor.generation", "ref.inference", "actor.training")
CHAIN = ("B", "C", "D", "B")


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _snapshot(rt: Runtime, module, refs: dict) -> dict:
    """Where the runtime keeps each shard, against what the plan says."""
    plan = module.plan(rt.plan)
    model = resident_bytes_by_model_stage(module, plan)
    out = {"plan": rt.plan, "bad": _check(rt, refs), "placement": {}, "device_bytes": {}, "model_bytes": {}}
    for ms in STAGES:
        offloaded = next(p.offload for p in plan.placements if str(p.model_stage) == ms)
        places = rt.placement(ms)
        state = {k: v for k, v in rt.state(ms).items() if k in places}
        out["placement"][ms] = {"offload": offloaded, "places": sorted(set(places.values())),
                                "names": set(places) == set(state),
                                "pinned": sorted({t.is_pinned() for t in state.values()}),
                                "devices": sorted({t.device.type for t in state.values()})}
        out["device_bytes"][ms] = rt.device_bytes(ms)
        out["model_bytes"][ms] = model.get(ms, {}).get(rt.rank, 0)
        out["held_bytes"] = out.get("held_bytes", 0) + _nbytes(state.values())
    out["device_total"] = rt.device_bytes()
    gathered = {ms: rt.gather_state_dict(ms) for ms in STAGES}
    out["gather_ok"] = all(_same(gathered[ms][n], refs[ms][n]) for ms in STAGES for n in refs[ms])
    return out


def _run(rank, world):
    module = ir.parse_source(SOURCE, "offload.nir")
    rt = Runtime(module, "A", rank=rank, world_size=world, verify=True)
    refs = {ms: _reference(rt, ms, seed=i) for i, ms in enumerate(STAGES)}
    for ms, full in refs.items():
        rt.register(ms, rt.shard_state_dict(ms, full))
    steps = [_snapshot(rt, module, refs)]
    for target in CHAIN:
        rt.compile(target)  # this rank's part; the replay needs the whole program
        whole = program_json(compile_transition(module, rt.plan, target))
        replay = verify_program(whole).peak_bytes.get(rank, 0)
        report = rt.transition(target)
        step = _snapshot(rt, module, refs)
        step.update(peak=report.peak_bytes, replay=replay, verified=report.verified)
        steps.append(step)
    # the stage's own work: device_state brings the shards up, write_back returns changes
    up = rt.device_state("ref.inference")
    names = sorted(rt.placement("ref.inference"))
    same = all(_same(up[n], rt.state("ref.inference")[n]) for n in names)
    on_device = sorted({up[n].device.type for n in names})
    original = up[names[0]].clone()
    up[names[0]].add_(1)
    private = _same(rt.state("ref.inference")[names[0]], original)  # a copy: the state waits for write_back
    rt.write_back("ref.inference", up)
    held = rt.state("ref.inference")[names[0]]
    changed = _same(held, up[names[0]]) and not _same(held, original)
    up[names[0]].copy_(original)
    rt.write_back("ref.inference", up)
    # a shard registered for an offloaded model-stage is taken to host memory
    registered = rt.shard_state_dict("ref.inference", refs["ref.inference"])
    rt.register("ref.inference", registered)
    steps.append(_snapshot(rt, module, refs))
    steps[-1]["device_state"] = {"same": same, "devices": on_device, "written_back": changed, "private": private}
    # out of offload with a failure on rank 1 after its exchange: every rank keeps plan B
    try:
        rt.transition("D", fault=(1, 0, "unpack"))
        aborted = None
    except TransitionAborted as error:
        aborted = str(error)
    steps.append(_snapshot(rt, module, refs))
    steps[-1]["aborted"] = aborted
    return steps


@pytest.fixture(scope="module")
def chain():
    results = spawn(_run, WORLD)
    for result in results:
        assert result[0] == "ok", result[1]
    return [r[1] for r in results]


def test_state_is_byte_exact_through_offloaded_layouts(chain):
    for rank, steps in enumerate(chain):
        for step in steps:
            assert step["bad"] == [], (rank, step["plan"], step["bad"])
            assert step["gather_ok"], (rank, step["plan"])
            assert step.get("verified", True), (rank, step["plan"])


def test_offloaded_shards_live_in_host_memory_and_the_rest_on_the_device(chain):
    for rank, steps in enumerate(chain):
        for step in steps:
            for ms, where in step["placement"].items():
                assert where["names"], (rank, step["plan"], ms)
                if not where["places"]:
                    continue  # this rank holds nothing of it
                assert where["places"] == (["host"] if where["offload"] else ["device"]), (rank, step["plan"], ms)
                assert where["devices"] == ["cpu"]
                if where["offload"]:
                    # a CPU runtime pins nothing, also where CUDA exists (test_offload_cuda pins)
                    assert where["pinned"] == [False], (rank, step["plan"], ms)


def test_device_bytes_match_the_compilers_memory_model(chain):
    for rank, steps in enumerate(chain):
        for step in steps:
            for ms in ("actor.generation", "ref.inference"):  # weights only: the model's resident bytes exactly
                assert step["device_bytes"][ms] == step["model_bytes"][ms], (rank, step["plan"], ms)
            offloaded = sum(1 for w in step["placement"].values() if w["offload"])
            assert step["device_total"] == sum(step["device_bytes"].values())
            assert step["device_total"] <= step["held_bytes"]
            if offloaded and any(w["places"] == ["host"] for w in step["placement"].values()):
                assert step["device_total"] < step["held_bytes"], (rank, step["plan"])


def test_transition_peak_equals_the_verifiers_replay(chain):
    for rank, steps in enumerate(chain):
        for step in steps[1:-2]:
            assert step["peak"] == step["replay"], (rank, step["plan"], step["peak"], step["replay"])


def test_device_state_brings_offloaded_shards_up_and_write_back_returns_changes(chain):
    for rank, steps in enumerate(chain):
        assert steps[-2]["device_state"] == {"same": True, "devices": ["cpu"], "written_back": True,
                                             "private": True}, rank


def test_an_aborted_transition_out_of_offload_keeps_the_host_state(chain):
    for rank, steps in enumerate(chain):
        last = steps[-1]
        assert last["aborted"] is not None and "injected" in last["aborted"], (rank, last["aborted"])
        assert last["plan"] == "B" and last["bad"] == [] and last["gather_ok"], rank
        assert last["placement"]["ref.inference"]["places"] in (["host"], []), rank


def test_prepare_warms_every_stream_that_reads_or_writes_host_memory():
    """On CUDA the pack kernels address offloaded shards in place whatever their layout,
    so `prepare` must compile the variants of every stream with host pieces, not only of
    the chunks the device path packs with the kernels (strided, many segments)."""
    from nereus.runtime.offload import offloaded_units
    from nereus.runtime.prepare import stream_views
    from nereus.runtime.program import rank_program
    from nereus.runtime.wires import TORCH_DTYPES

    module = ir.parse_source(SOURCE, "offload.nir")
    flagged_any = 0
    for source, target in (("A", "B"), ("B", "C"), ("C", "D")):
        program = program_json(compile_transition(module, source, target))
        host = offloaded_units(program)
        for gpu in range(WORLD):
            prog = rank_program(program, gpu)
            flagged = stream_views(prog, TORCH_DTYPES, host)
            on_host = {(kind, i) for i, (kind, _, away) in enumerate(flagged) if away}
            # a stream is flagged exactly when some packed piece of it is an offloaded unit's
            expected = set()
            plain = stream_views(prog, TORCH_DTYPES)
            assert [(k, len(v)) for k, v, _ in plain] == [(k, len(v)) for k, v, _ in flagged]
            assert not any(away for _, _, away in plain)
            for i, (kind, views, _) in enumerate(flagged):
                phase = "before" if kind == "pack" else "after"
                units = {unit for p, unit in host if p == phase}
                if units and _stream_units(prog, kind, i, flagged) & units:
                    expected.add((kind, i))
            assert on_host == expected
            flagged_any += len(on_host)
        assert host  # each of these moves has offloaded units
    assert flagged_any


def _stream_units(prog, kind: str, index: int, flagged: list) -> set:
    """The units of stream `index` of `stream_views`' list (same enumeration order)."""
    from nereus.runtime.execution_plan import plan_for
    from nereus.runtime import streams

    plan = plan_for(prog, streams.CHUNK_BYTES)
    i = 0
    for work, planned in zip(prog.rounds, plan.rounds):
        for k, messages, flags in (("pack", work.sends, planned.send_in_stream),
                                   ("unpack", work.recvs, planned.recv_in_stream)):
            per_peer: dict = {}
            for msg, in_stream in zip(messages, flags):
                for p, streamed in zip(msg.pieces, in_stream):
                    if streamed:
                        per_peer.setdefault(msg.peer, set()).add(p.src_unit if k == "pack" else p.dst_unit)
            for units in per_peer.values():
                if i == index:
                    assert k == kind
                    return units
                i += 1
    raise AssertionError(f"no stream {index}")


def test_reserve_memory_reads_the_stream_plans_it_is_given():
    """`reserve_memory` runs on CUDA only; with room 0 it allocates nothing, so its CUDA
    branch runs here too: it must read `stream_plans`' (kind, plan, on_host) triples."""
    from nereus.runtime.prepare import reserve_memory
    from nereus.runtime.program import rank_program
    from nereus.runtime.wires import TORCH_DTYPES

    module = ir.parse_source(SOURCE, "offload.nir")
    program = program_json(compile_transition(module, "A", "B"))
    for gpu in range(WORLD):
        assert reserve_memory(rank_program(program, gpu), set(), "cuda", TORCH_DTYPES, 0) == 0


ONE = """
cluster one { nodes 1 gpus_per_node 1 gpu { mem 64MB flops 1TFLOPS hbm 100GB/s } intra 10GB/s inter 1GB/s host_mem 1GB }
model actor = llama { layers 1 hidden 32 heads 4 kv_heads 2 ffn 64 vocab 64 }
workload w { batch 2 prompt 4 response 4 microbatch 1  inference: actor }
plan A { actor.inference dp 1 on 0  offload }
"""


def test_a_cpu_runtime_pins_no_host_memory_on_a_gpu_host(monkeypatch):
    """A gloo run on a host with CUDA (auto picks gloo when there are fewer GPUs than
    processes) pinned its offloaded shards: pinning gains nothing where the device is the
    host, costs cudaHostAlloc, and fails in a process forked after CUDA started ("CUDA
    error: initialization error", seen on the H200 image). Here CUDA is faked available:
    torch's CPU build raises on any pin."""
    from runtime_helpers import single_process_control

    single_process_control()  # the default group: gloo, one process
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    rt = Runtime(ir.parse_source(ONE, "one.nir"), "A")
    assert rt.device.type == "cpu"
    full = {n: torch.randn(s).to(d) for n, (s, d) in rt.tensor_specs("actor.inference").items()}
    rt.register("actor.inference", rt.shard_state_dict("actor.inference", full))
    assert all(not t.is_pinned() for t in rt.state("actor.inference").values())
