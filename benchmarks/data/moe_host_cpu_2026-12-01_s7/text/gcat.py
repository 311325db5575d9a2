import atexit, gc, os, runpy, sys, time
import nereus.runtime.runtime as R
keep = []
orig = R.Runtime.transition
def transition(self, *a, **k):
    if not keep or keep[-1] is not self:
        keep.append(self)
    return orig(self, *a, **k)
R.Runtime.transition = transition
def done():
    if os.environ.get("RANK") != "0" or not keep:
        return
    del keep[:-1]
    gc.collect()
    ts = []
    for _ in range(5):
        t = time.perf_counter(); gc.collect(); ts.append(time.perf_counter() - t)
    print("GCAT last runtime alive: full collection min %.4f median %.4f s, tracked %d" % (min(ts), sorted(ts)[2], len(gc.get_objects())), file=sys.stderr)
atexit.register(done)
script = sys.argv[1]
sys.argv = sys.argv[1:]
sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
runpy.run_path(script, run_name="__main__")
