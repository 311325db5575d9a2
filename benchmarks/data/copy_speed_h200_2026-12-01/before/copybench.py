"""Single GPU: how fast the same-GPU copies of a DP -> TP change run (rank 0's shards of
8 Llama-8B layers + embedding + LM head, bf16), by copy method."""
import time, statistics, json, torch
from nereus.runtime import packing
dev = torch.device("cuda")
H, KV, F, V, L = 4096, 1024, 14336, 128256, 8
specs = []
for l in range(L):
    specs += [((H, H), 0), ((KV, H), 0), ((KV, H), 0), ((H, H), 1), ((F, H), 0), ((F, H), 0), ((H, F), 1), ((H,), None), ((H,), None)]
specs += [((V, H), 0), ((V, H), 0), ((H,), None)]
full = [torch.randn(s, device=dev, dtype=torch.bfloat16) for s, _ in specs]
def src_views():
    out = []
    for t, (s, d) in zip(full, specs):
        if d is None: out.append(t)
        elif d == 0: out.append(t[: s[0] // 2])
        else: out.append(t[:, : s[1] // 2])
    return out
srcs = src_views()
nbytes = sum(v.numel() * 2 for v in srcs)
def alloc():
    return [torch.empty(v.shape, dtype=v.dtype, device=dev) for v in srcs]
def m_copy_pairs():
    d = alloc(); packing.copy_pairs(d, srcs); return d
def m_each():
    d = alloc()
    for a, b in zip(d, srcs): a.copy_(b)
    return d
def m_contig():
    return [v.contiguous() for v in srcs]
def m_dtensor():  # views for dim 0 / whole, .contiguous() for dim 1
    return [v if v.is_contiguous() else v.contiguous() for v in srcs]
def m_foreach_all():
    d = alloc(); torch._foreach_copy_(d, srcs); return d
res = {}
for name, fn in [("copy_pairs", m_copy_pairs), ("each_copy_", m_each), ("contiguous", m_contig), ("dtensor_like", m_dtensor), ("foreach_all", m_foreach_all)]:
    for _ in range(3): fn()
    torch.cuda.synchronize()
    dev_t, host_t = [], []
    for _ in range(15):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize(); t0 = time.perf_counter(); s.record()
        out = fn()
        host = time.perf_counter() - t0
        e.record(); torch.cuda.synchronize()
        dev_t.append(s.elapsed_time(e) / 1e3); host_t.append(host)
        del out
    res[name] = {"device_ms": statistics.median(dev_t) * 1e3, "host_ms": statistics.median(host_t) * 1e3}
# per-kind bandwidth: contiguous dim-0 slices vs strided dim-1 slices, copy_ each
for kind in (0, 1):
    pairs = [(v, torch.empty(v.shape, dtype=v.dtype, device=dev)) for v, (_, d) in zip(srcs, specs) if d == kind]
    b = sum(v.numel() * 2 for v, _ in pairs)
    for _ in range(2):
        for v, d in pairs: d.copy_(v)
    ts = []
    for _ in range(10):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        for v, d in pairs: d.copy_(v)
        e.record(); torch.cuda.synchronize(); ts.append(s.elapsed_time(e) / 1e3)
    res[f"dim{kind}_copy_GBps"] = b / statistics.median(ts) / 1e9
    if kind == 0:
        ts = []
        for _ in range(10):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record(); torch._foreach_copy_([d for _, d in pairs], [v for v, _ in pairs]); e.record()
            torch.cuda.synchronize(); ts.append(s.elapsed_time(e) / 1e3)
        res["dim0_foreach_GBps"] = b / statistics.median(ts) / 1e9
res["bytes"] = nbytes
print(json.dumps(res), flush=True)
# widened strided copies: the dim-1 pairs reinterpreted as int64 (rows are contiguous)
pairs = [(v, torch.empty(v.shape, dtype=v.dtype, device=dev)) for v, (_, d) in zip(srcs, specs) if d == 1]
b = sum(v.numel() * 2 for v, _ in pairs)
out = {}
for wide in (torch.int16, torch.int32, torch.int64):
    wp = [(v.view(wide), d.view(wide)) for v, d in pairs]
    for v, d in wp: d.copy_(v)
    ts = []
    for _ in range(10):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        for v, d in wp: d.copy_(v)
        e.record(); torch.cuda.synchronize(); ts.append(s.elapsed_time(e) / 1e3)
    out[f"dim1_as_{str(wide).split('.')[1]}_GBps"] = b / statistics.median(ts) / 1e9
for v, d in pairs:
    d.zero_(); d.view(torch.int64).copy_(v.view(torch.int64)); assert torch.equal(d, v)
# the Triton pack kernels on the same strided views (one chunk's worth: into one buffer)
if packing.kernels() is not None:
    views = [v for v, _ in pairs]
    offsets, total = packing.layout([v.numel() * 2 for v in views])
    buf = torch.empty(total, dtype=torch.uint8, device=dev)
    import os
    for _ in range(3): packing.pack(views, offsets, total, out=buf)
    torch.cuda.synchronize()
    ts = []
    for _ in range(10):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record(); packing.pack(views, offsets, total, out=buf); e.record(); torch.cuda.synchronize()
        ts.append(s.elapsed_time(e) / 1e3)
    out["dim1_triton_pack_GBps"] = b / statistics.median(ts) / 1e9
    ts = []
    for _ in range(10):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record(); packing.torch_pack(views, offsets, total, out=buf); e.record(); torch.cuda.synchronize()
        ts.append(s.elapsed_time(e) / 1e3)
    out["dim1_torch_pack_GBps"] = b / statistics.median(ts) / 1e9
print(json.dumps(out))
