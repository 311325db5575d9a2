"""compile_child: pack kernel variants compiled in a child process. On the CPU box the
child is a stand-in command (the real one compiles for a GPU: test_compile_child_cuda.py);
what is tested here is what the parent does with it: which variants go to which child,
joining a running child, the deadline, a failure turning children off, the child's GPU,
and that the child compiles exactly the variant a launch asks for."""

import json
import logging
import os
import sys
import time

import pytest
import torch

from nereus.backends.triton import compile_child, kernels
from nereus.backends.triton.packer import Packer
from nereus.backends.triton.segments import Piece
from nereus.backends.triton.tables import build_launches

GPU = torch.device("cuda", 0)  # only its index is read: no CUDA needed


@pytest.fixture
def children(monkeypatch, tmp_path):
    """Children that record what they were given (stdin, CUDA_VISIBLE_DEVICES) in a file,
    after `sleep` seconds, and exit with `status` (stderr: `say`)."""
    monkeypatch.setattr(compile_child, "_off", None)
    monkeypatch.setattr(compile_child, "_running", {})
    monkeypatch.setattr(compile_child, "_children", [])
    monkeypatch.delenv("NEREUS_PACK_COMPILE", raising=False)
    log = tmp_path / "children.jsonl"
    settings = {"sleep": 0.0, "status": 0, "say": ""}
    script = (
        "import json, os, sys, time\n"
        "variants = json.loads(sys.stdin.read())\n"
        f"time.sleep({{sleep}})\n"
        f"open({str(log)!r}, 'a').write(json.dumps([variants, os.environ.get('CUDA_VISIBLE_DEVICES')]) + '\\n')\n"
        "sys.stderr.write({say!r})\n"
        "sys.exit({status})\n"
    )
    monkeypatch.setattr(compile_child, "command",
                        lambda: [sys.executable, "-c", script.format(**settings)])

    def seen():
        return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []

    yield settings, seen
    compile_child._kill_children()


A, B, C = ("pack", 8, 2, 16, 256), ("unpack", 8, 2, 16, 256), ("pack", 4, 1, 8, 64)


def test_a_child_gets_the_variants_and_is_waited_for(children):
    settings, seen = children
    settings["sleep"] = 0.5
    batch = compile_child.start({A, B}, GPU)
    assert batch is not None and not batch.wait(0.01)  # still compiling
    assert batch.wait(30)
    assert seen() == [[[list(A), list(B)], "0"]]
    assert compile_child._running == {} and compile_child._children == []


def test_a_variant_a_running_child_has_is_joined_not_compiled_again(children):
    settings, seen = children
    settings["sleep"] = 0.5
    first = compile_child.start({A, B}, GPU)
    second = compile_child.start({B, C}, GPU)  # B is in the first child: only C is new
    assert set(second.children) > set(first.children)
    assert compile_child.start({A}, GPU, new=False).children == first.children
    assert second.wait(30) and first.wait(30)
    assert sorted(v for v, _ in seen()) == sorted([[list(A), list(B)], [list(C)]])
    assert compile_child.start({A}, GPU, new=False) is None  # nothing running any more


def test_the_child_sees_only_the_parents_gpu(children, monkeypatch):
    settings, seen = children
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5")
    assert compile_child.start({A}, torch.device("cuda", 1)).wait(30)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-aa, GPU-bb")
    assert compile_child.start({A}, torch.device("cuda", 1)).wait(30)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert compile_child.start({A}, torch.device("cuda", 1)).wait(30)
    assert [gpu for _, gpu in seen()] == ["5", "GPU-bb", "1"]


def test_a_failed_child_turns_children_off_with_its_last_line_logged(children, caplog):
    settings, seen = children
    settings["status"], settings["say"] = 1, "Traceback ...\nRuntimeError: no ptxas\n"
    with caplog.at_level(logging.WARNING, logger="nereus.pack"):
        assert compile_child.start({A}, GPU).wait(30)
    assert "exit status 1: RuntimeError: no ptxas" in compile_child._off
    assert "compile in this process from now on" in caplog.text
    assert compile_child.start({B}, GPU) is None and len(seen()) == 1


def test_a_child_past_its_deadline_is_killed(children, monkeypatch):
    settings, seen = children
    settings["sleep"] = 60
    monkeypatch.setattr(compile_child, "DEADLINE_S", 0.5)
    started = time.monotonic()
    batch = compile_child.start({A}, GPU)
    assert batch.wait()
    assert time.monotonic() - started < 10
    assert batch.children[0].process.returncode != 0 and "killed" in compile_child._off
    assert seen() == []


def test_no_child_off_cuda_or_when_inline(children, monkeypatch):
    assert compile_child.start({A}, torch.device("cpu")) is None
    monkeypatch.setenv("NEREUS_PACK_COMPILE", "inline")
    assert compile_child.start({A}, GPU) is None
    monkeypatch.setenv("NEREUS_PACK_COMPILE", "fork")
    with pytest.raises(ValueError, match="NEREUS_PACK_COMPILE='fork': choose one of process, inline"):
        Packer(backend="triton")
    assert children[1]() == []


def test_a_forked_process_forgets_its_parents_children(children):
    settings, _ = children
    settings["sleep"] = 2
    batch = compile_child.start({A}, GPU)
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child process: nothing running that it could wait for
        os.write(write, b"%d" % (len(compile_child._running) + len(compile_child._children)))
        os._exit(0)
    os.waitpid(pid, 0)
    assert os.read(read, 16) == b"0"
    assert len(compile_child._running) == 1
    batch.wait(30)


def test_compile_only_compiles_the_variant_a_launch_runs(monkeypatch):
    """The child's warmup and the parent's launch must name the same compiled kernel:
    same constexprs and options, same argument dtypes (all pointers 16-byte aligned)."""
    calls = {}

    class Kernel:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: calls.setdefault("run", ([a.dtype for a in args], kwargs))

        def warmup(self, *args, grid, **kwargs):
            calls["warmup"] = (list(args), kwargs)

    monkeypatch.setattr(kernels, "move_tiles_kernel", Kernel())
    for kind, word, vec, rows, cols in [("pack", 8, 2, 16, 256), ("unpack", 2, 1, 64, 64), ("pack", 4, 2, 4, 1024)]:
        calls.clear()
        inner = 64 // word
        piece = Piece(word, vec, 0, 0, 1, inner, inner, inner, 0, 0)
        (launch,) = build_launches([piece], 0, "dst" if kind == "pack" else "src", (rows, cols), vec)
        table = torch.zeros(1, dtype=torch.int64)
        kernels.run_launch(launch, kernels.variant_rel(kind), table, table)
        kernels.compile_only((kind, word, vec, rows, cols))
        assert calls["warmup"] == calls["run"], (kind, word, vec, rows, cols)
        assert calls["run"][1]["ROWS"] == rows and calls["run"][1]["num_warps"] == launch.num_warps
