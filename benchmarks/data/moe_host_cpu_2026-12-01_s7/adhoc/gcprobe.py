import atexit, gc, os, runpy, sys, time
rank = os.environ.get("RANK", "0")
log = []
t = [0.0]
def cb(phase, info):
    if phase == "start":
        t[0] = time.perf_counter()
    elif info["generation"] == 2:
        log.append((round(time.perf_counter() - t[0], 4), info["collected"]))
        if False:
            import collections
            objs = gc.get_objects()
            c = collections.Counter(type(o).__module__ + "." + type(o).__qualname__ for o in objs)
            print("GCPROBE mid", len(objs), c.most_common(30), file=sys.stderr)
            del objs
gc.callbacks.append(cb)
def done():
    if rank == "0":
        print("GCPROBE gen2", len(log), "collections, total", round(sum(x[0] for x in log), 3), "seconds:", [x[0] for x in log][:40], file=sys.stderr)
        objs = gc.get_objects()
        print("GCPROBE tracked objects at exit:", len(objs), file=sys.stderr)
        import collections
        c = collections.Counter(type(o).__module__ + "." + type(o).__qualname__ for o in objs)
        print("GCPROBE types", c.most_common(25), file=sys.stderr)
        t0 = time.perf_counter(); gc.collect(); print("GCPROBE full collect at exit", time.perf_counter() - t0, file=sys.stderr)
atexit.register(done)
if os.environ.get("GCPAUSE") == "1":
    import functools
    import nereus.runtime.runtime as R
    orig = R.Runtime.transition
    @functools.wraps(orig)
    def transition(self, *a, **k):
        was = gc.isenabled()
        gc.disable()
        try:
            return orig(self, *a, **k)
        finally:
            if was:
                gc.enable()
    R.Runtime.transition = transition
script = sys.argv[1]
sys.argv = sys.argv[1:]
sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
runpy.run_path(script, run_name="__main__")
