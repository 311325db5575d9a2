"""compile_child on a CUDA device (CUDA only): a child process compiles pack kernel
variants into Triton's cache, and the parent's own compile of them then compiles nothing
(no new kernel binary in the cache: it loads the child's); the packer's background compile
goes through a child, and the kernels it loads pack and unpack byte-exact. Run in a fresh
process with a fresh Triton cache (the test process may have the interpreter on)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")

SCRIPT = textwrap.dedent("""
    import glob, json, os
    import torch
    from nereus.backends.triton import compile_child
    from nereus.backends.triton.packer import Packer
    from nereus.runtime import packing

    cache, dev = os.environ["TRITON_CACHE_DIR"], torch.device("cuda", 0)
    binaries = lambda: sorted(glob.glob(f"{cache}/**/move_tiles_kernel.cubin", recursive=True))
    packer = Packer(backend="triton")
    variants = {("pack", 8, 2, 16, 256), ("unpack", 4, 1, 8, 64)}
    batch = packer.compile_elsewhere(variants, dev)
    ended = batch is not None and batch.wait(300)
    by_child = binaries()
    packer.compile(variants, dev)
    out = {"ended": ended, "off": compile_child._off, "by_child": len(by_child), "after_parent": binaries() == by_child}

    # the background compile of a prepared-JIT packer goes through a child too
    started = []
    real_start = compile_child.start
    compile_child.start = lambda *a, **k: started.append(k.get("new", True)) or real_start(*a, **k)
    packer.jit = "prepared"
    big = torch.randn(96, 40, device=dev)
    half = torch.randn(64, 48, device=dev).to(torch.bfloat16)
    views = [big[:, 4:36], half[3:9], half[:, 1:4]]
    offsets, total = packing.layout([v.numel() * v.element_size() for v in views])
    expected = packing.torch_pack(views, offsets, total)
    pieces = lambda b: torch.cat([b[o:o + v.numel() * v.element_size()] for v, o in zip(views, offsets)])
    packer.pack_into(views, offsets, total)
    packer.wait_compiled()
    fallbacks = packer.fallback_calls
    packed = packer.pack_into(views, offsets, total)
    targets = [torch.zeros_like(v) for v in views]
    packer.unpack_from(packed, targets, offsets)
    torch.cuda.synchronize()
    out.update(started=started, fallbacks=packer.fallback_calls - fallbacks, off_after=compile_child._off,
               packed=torch.equal(pieces(packed), pieces(expected)),
               unpacked=all(torch.equal(t, v) for t, v in zip(targets, views)))
    print(json.dumps(out))
""")


def test_the_parent_loads_what_a_child_compiled(tmp_path):
    env = dict(os.environ, TRITON_CACHE_DIR=str(tmp_path / "triton"), NEREUS_PACK_COMPILE="process",
               PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    env.pop("TRITON_INTERPRET", None)
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["ended"] and out["off"] is None and out["by_child"] == 2, out
    assert out["after_parent"], out  # the parent compiled nothing of its own
    assert True in out["started"] and out["off_after"] is None, out
    assert out["fallbacks"] == 0 and out["packed"] and out["unpacked"], out
