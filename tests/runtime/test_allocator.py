"""Room in the caching allocator ahead of a round (runtime/allocator.py): the large-pool
bytes the execution plan gives each round are those of the after-shards the round
allocates first, each shard once and none a keep hands over; how much to reserve never
exceeds what the cache lacks nor what the device has free past the margin; off CUDA,
under another allocator, with caching off or a max split size nothing is reserved, and an
allocator that cannot answer (or an OOM race) costs the round nothing; nor does it fail
parking.real_room. torch.cuda's answers are faked here; the reservation on a device:
test_allocator_cuda.py."""

from __future__ import annotations

import pytest
import torch

import nereus.ir as ir
from nereus.backends.json_program import program_json
from nereus.passes import compile_transition
from nereus.runtime import allocator, execution_plan
from nereus.ir.model import Model
from nereus.runtime.program import rank_program

from runtime_helpers import naive_program, oracle_units, tensor_list

# large enough that most shards come from the allocator's large pool (> 1 MiB)
LLAMA = "llama { layers 2 hidden 512 heads 8 kv_heads 2 ffn 1024 vocab 1024 }"
CASES = [("dp 1 tp 2 on 0..1", "dp 2 on 0..1"),  # both ways
         ("dp 1 tp 2 on 0..1", "dp 2 tp 2 on 0..3"),  # extend: GPUs 0 and 1 keep theirs in place
         ("dp 1 pp 2 on 0..1", "dp 1 tp 2 on 2..3"),
         ("dp 1 on 0", "dp 1 pp 2 on 0..1")]  # GPU 0 keeps, copies and sends
MiB = 1 << 20


def _programs():
    for before, after in CASES:
        module = ir.parse_source(f"""
cluster c {{ nodes 1 gpus_per_node 4 gpu {{ mem 80GB flops 1TFLOPS hbm 100GB/s }} intra 10GB/s inter 1GB/s host_mem 64GB }}
model actor = {LLAMA}
workload w {{ batch 4 prompt 4 response 4 microbatch 1 training: actor }}
plan A {{ actor.training {before} }}
plan B {{ actor.training {after} }}
""", "allocator.nir")
        compiled = program_json(compile_transition(module, "A", "B"))
        for gpu in range(4):
            yield rank_program(compiled, gpu, direct_min_bytes=1024)
    # no alloc ops: each destination is allocated where a copy or a receive first writes it
    # (GPU 0 copies its first stage, GPU 1 receives the second)
    model = Model("actor", "llama", layers=2, hidden=512, heads=8, kv_heads=2, ffn=1024, vocab=1024)
    units = lambda dp, tp, pp, gpus: oracle_units(model, "actor.training", dp, tp, pp, gpus)  # noqa: E731
    naive = naive_program(units(1, 1, 1, [0]), units(1, 1, 2, [0, 1]), tensor_list(model, training=True),
                          rounds=2, gpus=2)
    naive["rounds"] = [{**r, "ops": [op for op in r["ops"] if op["op"] != "alloc"]} for r in naive["rounds"]]
    for gpu in range(2):
        yield rank_program(naive, gpu, direct_min_bytes=1024)


def _first_rounds(prog) -> dict:
    """(unit, tensor) → the index of the round that allocates it first, as the executor
    does: an alloc op of its unit, or the first copy or receive that writes it."""
    aliased = {(a.dst_unit, name) for w in prog.rounds for a in w.aliases for name in a.tensors}
    first = {}
    for work in prog.rounds:
        keys = [(unit, name) for unit in work.allocs for name in prog.after[unit]]
        keys += [(p.dst_unit, name) for p in work.copies for name in p.tensors]
        keys += [(p.dst_unit, name) for m in work.recvs for p in m.pieces for name in p.tensors]
        for key in keys:
            if key not in aliased:
                first.setdefault(key, work.index)
    return first


def test_each_round_counts_the_large_shards_it_allocates_first():
    seen_keeps = seen_large = seen_small = False
    for prog in _programs():
        plan = execution_plan.build_plan(prog, 128 * MiB)
        want = [{} for _ in prog.rounds]
        first = _first_rounds(prog)
        for (unit, name), index in first.items():
            nbytes = prog.after[unit][name].nbytes
            seen_large |= nbytes > MiB
            seen_small |= nbytes <= MiB
            if nbytes > MiB:
                want[index][unit] = want[index].get(unit, 0) + -(-nbytes // 512) * 512
        assert [dict(r.alloc_bytes) for r in plan.rounds] == want
        seen_keeps |= bool(plan.aliased)
        # every shard not handed over in place is allocated in some round
        assert set(first) == {(u, n) for u, shards in prog.after.items() for n in shards} - plan.aliased
    assert seen_keeps and seen_large and seen_small  # the cases exercise all three


def test_block_bytes_follow_the_allocators_pools():
    assert allocator.block_bytes(MiB) == 0  # the small pool
    assert allocator.block_bytes(MiB + 1) == MiB + 512
    assert allocator.block_bytes(3 * MiB) == 3 * MiB


def test_the_reservation_is_what_the_cache_lacks_within_the_free_memory():
    GiB = 1 << 30
    margin, least = allocator.MARGIN_BYTES, allocator.MIN_BYTES
    assert allocator.reservation(4 * GiB, 0, 80 * GiB) == 4 * GiB
    assert allocator.reservation(4 * GiB, 3 * GiB, 80 * GiB) == GiB  # the cache serves the rest
    assert allocator.reservation(4 * GiB, 4 * GiB, 80 * GiB) == 0
    assert allocator.reservation(4 * GiB, 0, 3 * GiB) == 3 * GiB - margin  # never the margin
    assert allocator.reservation(4 * GiB, 0, margin + least - 1) == 0  # too little to be worth it
    assert allocator.reservation(least - 1, 0, 80 * GiB) == 0


def test_nothing_is_reserved_off_cuda():
    assert allocator.reserve_ahead(torch.device("cpu"), 1 << 40) == 0


class _FakeCuda:
    """torch.cuda's allocator queries as a CUDA machine would answer them (on the CPU box)."""

    def __init__(self, monkeypatch, cached=0, free=80 << 30, backend="native", stats_error=None):
        self.blocks = []
        stats = {"reserved_bytes": {"large_pool": {"current": cached}}, "allocated_bytes": {"large_pool": {"current": 0}}}

        def nested(device=None):
            if stats_error is not None:
                raise stats_error
            return stats

        monkeypatch.setattr(torch.cuda, "memory_stats_as_nested_dict", nested)
        monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free, 141 << 30))
        monkeypatch.setattr(torch.cuda, "get_allocator_backend", lambda: backend)
        monkeypatch.setattr(allocator, "_allocate", lambda size, device: self.blocks.append(size))
        for name in ("PYTORCH_NO_CUDA_MEMORY_CACHING", "PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
            monkeypatch.delenv(name, raising=False)


CUDA = torch.device("cuda", 0)
GiB = 1 << 30


def test_the_block_is_what_the_cache_lacks(monkeypatch):
    fake = _FakeCuda(monkeypatch, cached=GiB)
    assert allocator.reserve_ahead(CUDA, 5 * GiB) == 4 * GiB and fake.blocks == [4 * GiB]


@pytest.mark.parametrize("name, value", [("PYTORCH_NO_CUDA_MEMORY_CACHING", "1"),
                                         ("PYTORCH_NO_CUDA_MEMORY_CACHING", ""),  # torch: set at all
                                         ("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:False,max_split_size_mb:512"),
                                         ("PYTORCH_ALLOC_CONF", "max_split_size_mb:128")])
def test_no_block_where_it_could_not_serve_the_shards(monkeypatch, name, value):
    # caching off: every allocation is a cudaMalloc anyway; a max split size: a block that
    # large is never split for a smaller request
    fake = _FakeCuda(monkeypatch, stats_error=AssertionError("not asked"))
    monkeypatch.setenv(name, value)
    assert allocator.reserve_ahead(CUDA, 5 * GiB) == 0 and fake.blocks == []


def test_other_allocator_settings_keep_the_block(monkeypatch):
    fake = _FakeCuda(monkeypatch)
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    assert allocator.reserve_ahead(CUDA, 5 * GiB) == 5 * GiB and fake.blocks == [5 * GiB]


def test_no_block_under_another_allocator_backend(monkeypatch):
    fake = _FakeCuda(monkeypatch, backend="cudaMallocAsync", stats_error=AssertionError("not asked"))
    assert allocator.reserve_ahead(CUDA, 5 * GiB) == 0 and fake.blocks == []


@pytest.mark.parametrize("error", [RuntimeError("memory stats not supported by this allocator"),
                                   KeyError("large_pool")])
def test_an_allocator_that_cannot_answer_costs_the_round_nothing(monkeypatch, error):
    fake = _FakeCuda(monkeypatch, stats_error=error)
    assert allocator.reserve_ahead(CUDA, 5 * GiB) == 0 and fake.blocks == []


def test_memory_taken_meanwhile_costs_the_round_nothing(monkeypatch):
    _FakeCuda(monkeypatch)

    def taken(size, device):  # another process allocated between the query and the block
        raise torch.cuda.OutOfMemoryError("CUDA out of memory")

    monkeypatch.setattr(allocator, "_allocate", taken)
    assert allocator.reserve_ahead(CUDA, 5 * GiB) == 0


@pytest.mark.parametrize("error", [RuntimeError("memory stats not supported by this allocator"), KeyError("all")])
def test_the_room_rollback_and_prepare_count_on_needs_no_allocator_statistics(monkeypatch, error):
    """parking.real_room (rollback="auto", prepare): an allocator that cannot answer its
    statistics leaves the device's free memory alone as the room, not a failed transition."""
    from nereus.runtime import parking

    _FakeCuda(monkeypatch, free=10 * GiB, stats_error=error)
    assert parking.real_room(CUDA) == int(parking.REAL_ROOM_FRACTION * 10 * GiB)
