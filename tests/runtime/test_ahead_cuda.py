"""Lowering ahead on a CUDA device (CUDA only): a first transition whose part the thread
lowered, whose replays it built and whose kernel variants it compiled runs every pack,
unpack and copy on the kernels, with no torch-path fallback; without the thread the same
first call falls back (benchmarks/multi_gpu/host_only.py: rank 0 of a 2-rank
expert-parallel change of a tiny Qwen3-MoE on one GPU, its peer's ops moving nothing)."""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "..", "..", "benchmarks", "multi_gpu", "host_only.py")


@functools.lru_cache(maxsize=None)
def _run(ahead: str) -> dict:
    env = dict(os.environ, NEREUS_LOWER_AHEAD=ahead,
               PYTHONPATH=os.pathsep.join([os.path.join(HERE, "..", ".."), os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, SCRIPT, "--shape", "tiny", "--layers", "2", "--moe", "train-ep2-tp2",
                           "--repeats", "1", "--wait-ahead"], capture_output=True, text=True, env=env, timeout=600,
                          cwd=os.path.dirname(SCRIPT))
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def _first_calls(ahead: str) -> dict:
    return _run(ahead)["cold_details"]


def test_a_first_call_lowered_ahead_runs_on_the_kernels():
    ahead, control = _first_calls("on"), _first_calls("off")
    assert ahead["cold a-b"]["lowered_ahead"] is True and ahead["cold a-b"]["fallbacks"] == 0, ahead
    assert control["cold a-b"]["lowered_ahead"] is False and control["cold a-b"]["fallbacks"] > 0, control


CONSTRUCT = """
import json, sys, torch
sys.path.insert(0, ".")
from host_only import join_fake
import moe_reshard as mr
import nereus.ir as ir
from nereus.runtime import Runtime, packing, streams
torch.cuda.set_device(0)
join_fake(0, 2)
module = ir.parse_source(mr.module_source("train-ep2-tp2", 2, 141 * 10**9, mr.SHAPES["tiny"], 2), "t.nir")
packer = packing.kernels().default_packer()
rt = Runtime(module, "A", device=torch.device("cuda", 0), ahead=sys.argv[1])
started = packer._compiling is not None  # right after the constructor returned
packer.wait_compiled()
chunk = torch.empty(streams.CHUNK_BYTES, dtype=torch.uint8, device="meta")
wanted = packer.launch_classes([("pack", [chunk], [0]), ("unpack", [chunk], [0])])
print(json.dumps({"started": started, "compiled": sorted(map(list, packer.compiled & wanted)),
                  "wanted": sorted(map(list, wanted)), "fallbacks": packer.fallback_calls}))
rt.close()
"""


@pytest.mark.parametrize("ahead", ["on", "off"])
def test_the_runtime_starts_the_compiler_at_construction(ahead):
    """A runtime that lowers ahead has Triton's compiler at work on a contiguous chunk's
    variants when its constructor returns (prepare.warm_compiler); one that does not, has not."""
    env = dict(os.environ,
               PYTHONPATH=os.pathsep.join([os.path.join(HERE, "..", ".."), os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, "-c", CONSTRUCT, ahead], capture_output=True, text=True, env=env,
                          timeout=300, cwd=os.path.dirname(SCRIPT))
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    if ahead == "on":
        assert got["started"] and got["compiled"] == got["wanted"] and got["fallbacks"] == 0, got
    else:
        assert not got["started"] and got["compiled"] == [], got


def _stepped(monkeypatch) -> tuple:
    """Run ahead.steps of a tiny expert-parallel change A -> B to the end, in a packer with
    nothing compiled. Returns (its first value, the compiled variants at each LATER, per
    replay built: (the variants compiled before its build, its variants, the steps
    yielded between it and the next build))."""
    import nereus.ir as ir
    from nereus.runtime import ahead, packing, replay

    sys.path.insert(0, os.path.dirname(SCRIPT))
    try:
        import moe_reshard as mr
    finally:
        sys.path.remove(os.path.dirname(SCRIPT))
    device = torch.device("cuda", torch.cuda.current_device())
    module = ir.parse_source(mr.module_source("train-ep2-tp2", 2, 141 * 10**9, mr.SHAPES["tiny"], 2), "t.nir")
    packer = packing.kernels().default_packer()
    monkeypatch.setattr(packer, "compiled", set())  # nothing compiled in this process yet
    builds = []
    real = replay.warm_steps

    def watched(*args, **kwargs):
        for variants in real(*args, **kwargs):
            builds.append([set(packer.compiled), set(variants), 0])
            yield variants

    monkeypatch.setattr(replay, "warm_steps", watched)
    first, later = None, []
    for value in ahead.steps(module, 0, device, 1 << 20, False, None, "A", "B"):
        assert first is None or value in ("streams", "compile", "later", "replay"), value  # the step log's names
        first = value if first is None else first
        if value is ahead.LATER:  # where the thread may park the pair: after the stream variants, before replays
            later.append((len(builds), set(packer.compiled)))
        elif builds:
            builds[-1][2] += 1
    return first, later, builds


def test_the_stream_variants_are_compiled_before_the_replays_are_built(monkeypatch):
    """A first call that comes while the thread builds the replays finds its streams'
    kernels compiled (a missing variant is a chunk on the torch path)."""
    from nereus.runtime import prepare
    from nereus.runtime.executor import TORCH_DTYPES

    first, later, builds = _stepped(monkeypatch)
    facts, lowered = first.value
    streamed = prepare.stream_classes(lowered, torch.device("cuda", torch.cuda.current_device()), TORCH_DTYPES,
                                      facts.offloaded)
    assert streamed and builds and streamed <= builds[0][0], (streamed, builds)
    assert len(later) == 1 and later[0][0] == 0 and streamed <= later[0][1], later


def test_each_replay_is_a_step_of_its_own_followed_by_its_variants(monkeypatch):
    """A call waiting for the step in progress waits for one replay's build, and the
    replays built before it have their variants compiled."""
    _, _, builds = _stepped(monkeypatch)
    assert len(builds) >= 2, builds
    for (_, variants, steps), (compiled_next, _, _) in zip(builds, builds[1:] + [[None, None, None]]):
        assert steps >= 1, builds  # the build ended its step
        if compiled_next is not None:
            assert variants <= compiled_next, builds
