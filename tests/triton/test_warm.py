"""Packer.warm: the kernel variants a transition will launch, found from meta views of the
real shapes (nothing allocated at full size) and run once on a scratch buffer."""

import torch

from nereus.backends.triton.packer import Packer
from nereus.runtime import packing


def _calls(device):
    big = torch.zeros(64, 48, dtype=torch.bfloat16, device=device)
    state = torch.zeros(96, 40, dtype=torch.float32, device=device)
    odd = torch.zeros(33, 7, dtype=torch.bfloat16, device=device)
    views = [big[:, 8:24], big[3:9], state[:, 4:36], odd[:, 1:4], state[5:6]]
    offsets, _ = packing.layout([v.numel() * v.element_size() for v in views])
    return [("pack", views, offsets), ("unpack", views[::-1], offsets)]


def _pieces(buffer, views, offsets):
    """The bytes of a packed buffer that belong to its pieces (padding left out)."""
    return torch.cat([buffer[o:o + v.numel() * v.element_size()] for v, o in zip(views, offsets)])


def test_meta_views_give_the_launch_classes_of_the_real_calls():
    packer = Packer(backend="triton")
    real = _calls("cpu")
    meta = _calls("meta")
    classes = packer.launch_classes(meta)
    assert classes == packer.launch_classes(real)
    assert {c[0] for c in classes} == {"pack", "unpack"} and len({c[1] for c in classes}) > 1  # several word sizes
    # the plans a real pack and unpack build launch exactly these classes
    for kind, views, offsets in real:
        total = offsets[-1] + views[-1].numel() * views[-1].element_size() + 8
        if kind == "pack":
            packer.pack_into(views, offsets, total)
        else:
            packer.unpack_from(torch.zeros(total, dtype=torch.uint8), views, offsets)
    built = {(kind, x.word, x.vec, x.rows, x.cols) for (kind, _), plan in packer._plans.items() for x in plan.launches}
    assert built == classes


def test_warm_runs_every_variant_once_without_touching_real_data():
    packer = Packer(backend="triton")
    assert packer.warm(_calls("meta"), torch.device("cpu")) == len(packer.launch_classes(_calls("meta")))
    # each compile is logged once with its seconds (host_only.py reports them)
    assert sorted(v for v, _ in packer.compile_log) == sorted(packer.launch_classes(_calls("meta")))
    assert all(seconds > 0 for _, seconds in packer.compile_log)
    assert Packer(backend="torch").warm(_calls("meta"), torch.device("cpu")) == 0


def test_prepared_jit_takes_the_torch_path_until_the_variants_are_compiled():
    packer = Packer(backend="triton")
    packer.jit = "prepared"
    (_, views, offsets), _ = _calls("cpu")
    for i, v in enumerate(views):
        v.copy_(torch.arange(v.numel()).view(v.shape).to(v.dtype) + i)
    total = offsets[-1] + views[-1].numel() * views[-1].element_size()
    expected = _pieces(packing.torch_pack(views, offsets, total), views, offsets)
    first = packer.pack_into(views, offsets, total)
    # the alignment padding between pieces is never written (nor read): compare the pieces
    assert packer.fallback_calls == 1 and torch.equal(_pieces(first, views, offsets), expected)
    packer._compiling.join()  # the missing variants compiled aside
    assert packer.launch_classes([("pack", views, offsets)]) <= packer.compiled
    second = packer.pack_into(views, offsets, total)
    assert packer.fallback_calls == 1 and torch.equal(_pieces(second, views, offsets), expected)


def test_wait_compiled_compiles_what_was_asked_for_while_a_compile_ran():
    packer = Packer(backend="triton")
    packer.jit = "prepared"
    (_, views, offsets), (_, back, back_offsets) = _calls("cpu")
    first = packer.launch_classes([("pack", views, offsets)])
    second = packer.launch_classes([("unpack", back, back_offsets)]) - first
    assert not packer.ready(first, torch.device("cpu"))  # starts the background compile
    assert second and not packer.ready(second, torch.device("cpu"))  # queued while it runs (or after)
    packer.wait_compiled()
    assert first | second <= packer.compiled
    assert packer.ready(first | second, torch.device("cpu"))


def test_ready_without_start_only_queues_until_compile_pending():
    packer = Packer(backend="triton")
    packer.jit = "prepared"
    (_, views, offsets), _ = _calls("cpu")
    classes = packer.launch_classes([("pack", views, offsets)])
    assert not packer.ready(classes, torch.device("cpu"), start=False)
    assert packer._compiling is None and packer._missing == classes  # nothing compiles beside the caller
    packer.compile_pending()
    packer._compiling.join()
    assert classes <= packer.compiled and packer.ready(classes, torch.device("cpu"), start=False)


def test_a_call_that_takes_the_torch_path_builds_no_tables(monkeypatch):
    # a cold transition's chunks all take the torch path (nothing compiled yet): building
    # their Triton tables only to drop them cost a cold 6-layer MoE change 0.2-0.45 s on
    # one H200. The call's classes are still queued for compiling, and a later call builds
    packer = Packer(backend="triton")
    packer.jit = "prepared"
    (_, views, offsets), (_, back, back_offsets) = _calls("cpu")
    built = []
    real = packer._launches
    monkeypatch.setattr(packer, "_launches", lambda *a: built.append(a) or real(*a))
    total = offsets[-1] + views[-1].numel() * views[-1].element_size()
    expected = _pieces(packing.torch_pack(views, offsets, total), views, offsets)
    assert torch.equal(_pieces(packer.pack_into(views, offsets, total), views, offsets), expected)
    target = [torch.zeros_like(v) for v in back]
    size = max(o + v.numel() * v.element_size() for v, o in zip(back, back_offsets))
    packer.unpack_from(packing.torch_pack(back, back_offsets, size), target, back_offsets)
    assert all(torch.equal(a, b) for a, b in zip(target, back))
    assert built == [] and packer._plans == {} and packer.fallback_calls == 2
    packer.wait_compiled()  # both calls' classes were queued all the same
    assert packer.compiled >= packer.launch_classes([("pack", views, offsets), ("unpack", target, back_offsets)])
    assert torch.equal(_pieces(packer.pack_into(views, offsets, total), views, offsets), expected)
    assert len(built) == 1 and packer.fallback_calls == 2


def test_a_call_that_cannot_launch_yet_runs_the_callers_torch_path():
    # the runtime passes its grouped torch path (packing.torch_pack / torch_unpack: one
    # _foreach_copy_ per dtype) for a first execution's chunks, not one copy_ per piece
    packer = Packer(backend="triton")
    packer.jit = "prepared"
    (_, views, offsets), _ = _calls("cpu")
    total = offsets[-1] + views[-1].numel() * views[-1].element_size()
    calls = []

    def pack(*args):
        calls.append("pack")
        return packing.torch_pack(*args)

    def unpack(*args):
        calls.append("unpack")
        packing.torch_unpack(*args)

    buffer = packer.pack_into(views, offsets, total, fallback_pack=pack)
    expected = _pieces(packing.torch_pack(views, offsets, total), views, offsets)
    assert torch.equal(_pieces(buffer, views, offsets), expected)
    target = [torch.zeros_like(v) for v in views]
    packer.unpack_from(buffer, target, offsets, fallback_unpack=unpack)
    assert calls == ["pack", "unpack"] and all(torch.equal(a, b) for a, b in zip(target, views))
    packer.wait_compiled()  # compiled now: the kernels run, the fallbacks are not called
    packer.pack_into(views, offsets, total, fallback_pack=pack)
    assert calls == ["pack", "unpack"]


def test_a_compile_waits_for_one_variant_of_another_threads_batch_not_the_batch(monkeypatch):
    import threading
    import time

    from nereus.backends.triton import variants as variants_module  # where Packer._compile builds its launch

    packer = Packer(backend="triton")
    classes = sorted(packer.launch_classes(_calls("meta")))
    assert len(classes) >= 4
    real = variants_module.build_launches

    def slow(*args, **kwargs):  # each variant's compile takes 0.3 s
        time.sleep(0.3)
        return real(*args, **kwargs)

    monkeypatch.setattr(variants_module, "build_launches", slow)
    batch = threading.Thread(target=packer._compile, args=(set(classes[1:]), torch.device("cpu")))
    batch.start()
    deadline = time.perf_counter() + 30
    while not packer._compile_turns.held() and time.perf_counter() < deadline:
        time.sleep(0.005)  # until the batch holds the lock for its first variant
    started = time.perf_counter()
    packer._compile({classes[0]}, torch.device("cpu"))
    waited = time.perf_counter() - started
    batch.join()
    assert classes[0] in packer.compiled and set(classes) <= packer.compiled
    assert waited < 0.3 * (len(classes) - 1) - 0.3, (waited, len(classes))  # not the whole batch


def test_threads_making_the_first_anchor_at_once_get_the_same_one(monkeypatch):
    import threading

    from nereus.backends.triton import kernels

    monkeypatch.setattr(kernels, "_ANCHORS", {})
    real_empty = torch.empty
    barrier = threading.Barrier(4)

    def empty(*args, **kwargs):  # every thread has missed the anchor before any makes it
        barrier.wait(5)
        return real_empty(*args, **kwargs)

    monkeypatch.setattr(kernels.torch, "empty", empty)
    got = [None] * 4

    def make(i):
        got[i] = kernels.anchor(torch.device("cpu"))

    threads = [threading.Thread(target=make, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len({a.data_ptr() for a in got}) == 1 and got[0] is kernels._ANCHORS[torch.device("cpu")]


def test_compile_turns_are_first_come_first_served_and_a_turn_given_up_blocks_no_one():
    import threading
    import time

    from nereus.backends.triton.packer import _Turns

    turns, order = _Turns(), []

    def waiter(name):
        with turns:
            order.append(name)

    def queued(n):
        deadline = time.perf_counter() + 10
        while turns._next < n and time.perf_counter() < deadline:
            time.sleep(0.005)

    turns.__enter__()  # this thread holds the lock
    first = threading.Thread(target=waiter, args=("a",))
    first.start()
    queued(2)
    with turns._cv:  # a waiter interrupted while waiting gives its turn up
        turns._given_up.add(turns._next)
        turns._next += 1
    second = threading.Thread(target=waiter, args=("b",))
    second.start()
    queued(4)
    turns.__exit__(None, None, None)
    first.join(10)
    second.join(10)
    assert order == ["a", "b"] and not turns.held()


def test_compile_ahead_compiles_in_the_background_and_counts_no_fallback():
    packer = Packer(backend="triton")
    packer.jit = "prepared"
    classes = packer.launch_classes(_calls("meta")[:1])
    assert packer.compile_ahead(classes, torch.device("cpu"))
    assert packer._compiling is not None  # a thread of its own: the caller did not compile them
    packer.wait_compiled()
    assert classes <= packer.compiled and packer.fallback_calls == 0
    assert sorted(v for v, _ in packer.compile_log) == sorted(classes)
    assert not packer.compile_ahead(classes, torch.device("cpu"))  # nothing left to compile
    assert not Packer(backend="torch").compile_ahead(classes, torch.device("cpu"))


def test_queued_variants_keep_the_callers_gpu(monkeypatch):
    """The background compile thread's own current device is GPU 0: variants asked for
    on an unindexed "cuda" device (a Runtime given device="cuda" on rank 1) are queued
    for the caller's current GPU, not for whatever GPU the thread would pick."""
    packer = Packer(backend="triton")
    packer.jit = "prepared"
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    assert not packer.ready({("pack", 8, 2, 2, 2048)}, torch.device("cuda"), start=False)
    assert packer._missing_device == torch.device("cuda", 1)
    assert not packer.ready({("pack", 8, 2, 1, 2048)}, torch.device("cuda", 0), start=False)
    assert packer._missing_device == torch.device("cuda", 0)
