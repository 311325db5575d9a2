"""Session 9 probe (1 x H200): can the pack kernels read/write pinned host memory
through UVA, and how fast against the current offload paths?"""
import ctypes, json, statistics, sys, time
import torch
from nereus.backends.triton import packer as P
from nereus.runtime import packing, offload

dev = torch.device("cuda:0")
torch.cuda.set_device(dev)
lib = ctypes.CDLL("libcuda.so.1")
lib.cuPointerGetAttribute.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint64]

def devptr(p):
    out = ctypes.c_uint64(0)
    rc = lib.cuPointerGetAttribute(ctypes.byref(out), 3, p)
    return rc, out.value

h = torch.empty(1 << 20, dtype=torch.uint8, pin_memory=True)
pg = torch.empty(1 << 20, dtype=torch.uint8)
res = {"uva": {"pinned": [h.data_ptr(), *devptr(h.data_ptr())], "pageable": [pg.data_ptr(), *devptr(pg.data_ptr())],
               "pinned_mid": [h.data_ptr() + 4096, *devptr(h.data_ptr() + 4096)]}}
print(res, flush=True)

orig = P._device
P._device = lambda views: dev  # probe only: every call's plan on the GPU
packer = P.Packer(backend="triton")

H, F, V, KV = 4096, 14336, 128256, 1024
def full_tensors(layers):
    ts = {}
    for i in range(layers):
        for n, shape, dim in (("q", (H, H), 0), ("k", (KV, H), 0), ("v", (KV, H), 0), ("o", (H, H), 1),
                              ("gate", (F, H), 0), ("up", (F, H), 0), ("down", (H, F), 1)):
            ts[f"{i}.{n}"] = (shape, dim)
    ts["embed"] = ((V, H), 0)
    ts["head"] = ((V, H), 0)
    return ts

tab = full_tensors(4)
# host full tensors (pinned), the rank's other half as host views
host = {n: torch.empty(s, dtype=torch.bfloat16, pin_memory=True) for n, (s, d) in tab.items()}
views = [t.narrow(d, t.shape[d] // 2, t.shape[d] // 2) for (n, (s, d)), t in zip(tab.items(), host.values())]
offsets, total = packing.layout([v.numel() * 2 for v in views])
buf = torch.randint(0, 255, (total,), dtype=torch.uint8, device=dev)
# local halves on the device (contiguous), destined for the first half of each host tensor
local_dev = [torch.randint(-100, 100, v.shape, device=dev).to(torch.bfloat16) for v in views]
local_host = [t.narrow(d, 0, t.shape[d] // 2) for (n, (s, d)), t in zip(tab.items(), host.values())]
print("bytes", total, "strided views", sum(not v.is_contiguous() for v in views), flush=True)

def timeit(fn, reps=5, warm=2):
    for _ in range(warm):
        fn(); torch.cuda.synchronize()
    out = []
    for _ in range(reps):
        torch.cuda.synchronize(); t0 = time.perf_counter(); fn(); torch.cuda.synchronize()
        out.append(time.perf_counter() - t0)
    return statistics.median(out) * 1e3

big_h = torch.empty(total, dtype=torch.uint8, pin_memory=True)
r = {}
r["dma_d2h_ms"] = timeit(lambda: big_h.copy_(buf, non_blocking=True))
r["dma_h2d_ms"] = timeit(lambda: buf.copy_(big_h, non_blocking=True))
for th in (1, 16):
    torch.set_num_threads(th)
    r[f"current_unpack_t{th}_ms"] = timeit(lambda: offload.unpack_to_host(buf, views, offsets))
    r[f"current_pack_t{th}_ms"] = timeit(lambda: offload.pack_from_host(views, offsets, buf))
    r[f"current_copies_d2h_t{th}_ms"] = timeit(lambda: packing.copy_pairs(local_host, local_dev))
    r[f"current_copies_h2d_t{th}_ms"] = timeit(lambda: packing.copy_pairs(local_dev, local_host))
torch.set_num_threads(1)
# correctness of the kernel paths against the current ones
ref = [v.clone() for v in views]
offload.unpack_to_host(buf, views, offsets); torch.cuda.synchronize()
ref = [v.clone() for v in views]
for v in views: v.zero_()
packer.unpack_from(buf, views, offsets); torch.cuda.synchronize()
ok_unpack = all(torch.equal(a, b) for a, b in zip(ref, views))
buf2 = torch.zeros_like(buf)
packer.pack_into(views, offsets, total, out=buf2); torch.cuda.synchronize()
ok_pack = torch.equal(buf2, buf)
for v in local_host: v.zero_()
packer.copy(list(zip(local_dev, local_host))); torch.cuda.synchronize()
ok_copy = all(torch.equal(a.cpu(), b) for a, b in zip(local_dev, local_host))
r.update(ok_unpack=ok_unpack, ok_pack=ok_pack, ok_copy=ok_copy)
print(r, flush=True)
r["kernel_unpack_ms"] = timeit(lambda: packer.unpack_from(buf, views, offsets))
r["kernel_pack_ms"] = timeit(lambda: packer.pack_into(views, offsets, total, out=buf2))
r["kernel_copies_d2h_ms"] = timeit(lambda: packer.copy(list(zip(local_dev, local_host))))
r["kernel_copies_h2d_ms"] = timeit(lambda: packer.copy(list(zip(local_host, local_dev))))
# contiguous pieces only, DMA per piece vs kernel
dense = [(v, o) for v, o in zip(views, offsets) if v.is_contiguous()]
def dma_dense():
    for v, o in dense:
        v.view(-1).view(torch.uint8).copy_(buf[o:o + v.numel() * 2], non_blocking=True)
r["dense_bytes"] = sum(v.numel() * 2 for v, _ in dense)
r["dma_dense_unpack_ms"] = timeit(dma_dense)
r["kernel_dense_unpack_ms"] = timeit(lambda: packer.unpack_from(buf, [v for v, _ in dense], [o for _, o in dense]))
strided = [(v, o) for v, o in zip(views, offsets) if not v.is_contiguous()]
r["strided_bytes"] = sum(v.numel() * 2 for v, _ in strided)
r["kernel_strided_unpack_ms"] = timeit(lambda: packer.unpack_from(buf, [v for v, _ in strided], [o for _, o in strided]))
r["kernel_strided_pack_ms"] = timeit(lambda: packer.pack_into([v for v, _ in strided], [o for _, o in strided], total, out=buf2))
for k in list(r):
    if k.endswith("_ms"):
        b = r["dense_bytes"] if "dense" in k else r["strided_bytes"] if "strided" in k else total
        r[k.replace("_ms", "_gbps")] = round(b / r[k] / 1e6, 1)
        r[k] = round(r[k], 2)
print(json.dumps({"name": "s9probe", "total_bytes": total, **res, **r}))
