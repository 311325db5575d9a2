"""An aborted transition leaves no reference cycle through the executor's frames.

Why: a failure kept as a live exception in a local (its traceback holds the frame, the
frame holds the local) ties the round's frame, and through `f_back` every caller's, into
a cycle that only the cyclic GC frees: the round's stream buffers and the process groups
outlive the transition and `destroy_process_group`. On gloo that kept the groups' worker
threads running into interpreter shutdown, where a worker releasing a finished
collective's tensors needs the GIL and std::terminate()s the process ("terminate called
without an active exception", SIGABRT: test_streams.py's fault case under CPU load).
Both ways a failure is kept while the round's ops complete are checked: an error after
posting (the injected "post" fault) and a failed pack inside a stream.
"""

from __future__ import annotations

import gc

import pytest
import torch
import torch.distributed as dist

from nereus.ir.model import Model
from nereus.runtime.control import TransitionAborted
from nereus.runtime.executor import execute
from nereus.runtime.program import rank_program
from nereus.runtime.state import shard_unit

from runtime_helpers import naive_program, oracle_units, reference_state, spawn, tensor_list

MODEL = Model("actor", "llama", layers=1, hidden=16, heads=2, kv_heads=2, ffn=32, vocab=32)
STAGE = "actor.training"


def _pack_fails(chunk, buffer):
    raise RuntimeError("pack failed (test)")


def _cyclic_frames(rank, world, tensors):
    """Each fault case's frames (file:function) that only the cyclic GC would free."""
    import nereus.runtime.streams as streams_module

    control = dist.new_group(backend="gloo")
    full = reference_state(tensors)
    before_units, after_units = (oracle_units(MODEL, STAGE, dp, tp, 1, [0, 1]) for dp, tp in ((1, 2), (2, 1)))
    program = naive_program(before_units, after_units, tensors, gpus=world)
    prog = rank_program(program, rank, direct_min_bytes=1 << 30)  # every piece in the stream
    out = {}
    for name, fault in (("post", (1, 0, "post")), ("pack", None)):
        before = {u["id"]: shard_unit(u, rank, full) for u in before_units if rank in u["gpus"]}
        pack = streams_module.pack_chunk
        if name == "pack" and rank == 1:
            streams_module.pack_chunk = _pack_fails
        gc.collect()
        gc.disable()
        gc.set_debug(gc.DEBUG_SAVEALL)  # what the collector finds stays in gc.garbage
        try:
            execute(prog, before, group=None, control=control, device=torch.device("cpu"), verify=True,
                    fault=fault, chunk_bytes=512, depth=2)
            aborted = False
        except TransitionAborted:
            aborted = True
        finally:
            streams_module.pack_chunk = pack
        gc.collect()
        frames = sorted({f"{o.f_code.co_filename.rsplit('/', 1)[-1]}:{o.f_code.co_name}"
                         for o in gc.garbage if type(o).__name__ == "frame"})
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()
        out[name] = {"aborted": aborted, "cyclic frames": frames}
    return out


@pytest.mark.multiprocess
def test_an_aborted_transition_leaves_no_frame_in_a_reference_cycle():
    results = spawn(_cyclic_frames, 2, tensor_list(MODEL, training=True))
    for rank, res in enumerate(results):
        assert res is not None and res[0] == "ok", f"rank {rank}: {res}"
        for name, case in res[1].items():
            assert case["aborted"], (rank, name)
            assert case["cyclic frames"] == [], (rank, name, case)
