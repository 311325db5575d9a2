import torch,time,triton
from nereus.backends.triton import replay as R, kernels as K, default_packer
dev=torch.device("cuda",0)
p=default_packer(); p.jit="prepared"
B=lambda s:(R.Box(2*s,(3,5),(5,1),0,4),R.Box(2*s+1,(3,5),(8,1),0,4))
mk=lambda n:R.Replay("copy",R.copy_pieces([B(i) for i in range(n)],(0,)*2*n),dev)
a,b=mk(1),mk(2)
print(triton.__version__,torch.__version__,"same classes",a.classes==b.classes,a.classes,"tiles%16 a",[x.tiles.data_ptr()%16 for x in a.launches],"b",[x.tiles.data_ptr()%16 for x in b.launches])
hits=[]
try: triton.knobs.runtime.jit_post_compile_hook=lambda *x,**k: hits.append(1)
except Exception as e: print("hook",e)
def cache():
    try: return sum(len(v[0]) for v in K.move_tiles_kernel.device_caches.values())
    except Exception as e: return repr(e)[:60]
p.compile(a.classes|b.classes,dev)
print("ready (prepared jit):",p.ready(a.classes,dev,start=False),"cache",cache(),"hooks",len(hits))
src=torch.randn(15,device=dev)
for name,r,n in (("b aligned",b,2),("a misaligned",a,1),("a again",a,1)):
    dst=torch.zeros(24,device=dev); tab=R.table([src.data_ptr(),dst.data_ptr()]*n,dev)
    c0,h0=cache(),len(hits); torch.cuda.synchronize(); t=time.perf_counter(); r.run(tab); torch.cuda.synchronize()
    print(name,f"{(time.perf_counter()-t)*1e3:.1f} ms","cache",c0,"->",cache(),"compile hooks",len(hits)-h0,"ok",torch.equal(dst.view(3,8)[:,:5],src.view(3,5)))
