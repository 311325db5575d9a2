import atexit, gc, os, runpy, sys, collections
import nereus.runtime.runtime as R
keep = []
orig = R.Runtime.transition
def transition(self, *a, **k):
    if not keep or keep[-1] is not self:
        keep.append(self)
    return orig(self, *a, **k)
R.Runtime.transition = transition

def reach(root, seen):
    c = collections.Counter()
    stack = [root]
    while stack:
        o = stack.pop()
        if id(o) in seen:
            continue
        seen.add(id(o))
        import types, torch
        if isinstance(o, (types.ModuleType, type, torch.Tensor)) or callable(o) and not isinstance(o, (list, dict, tuple)):
            continue
        if gc.is_tracked(o):
            c[type(o).__qualname__] += 1
        stack.extend(gc.get_referents(o))
    return c

def done():
    if os.environ.get("RANK") != "0" or not keep:
        return
    rt = keep[-1]
    import nereus.runtime.execution_plan as EP
    seen = set()
    # registered state first (the user's tensors), so caches do not count them
    c = reach(EP._PLANS, seen)
    print("REACH _PLANS", sum(c.values()), c.most_common(10), file=sys.stderr)
    for name, value in sorted(vars(rt).items()):
        c = reach(value, seen)
        n = sum(c.values())
        if n > 500:
            print("REACH rt.%s" % name, n, c.most_common(8), file=sys.stderr)
    for name in dir(EP):
        v = getattr(EP, name)
        if isinstance(v, dict) or hasattr(v, "cache_info"):
            c = reach(v, seen)
            if sum(c.values()) > 500:
                print("REACH execution_plan.%s" % name, sum(c.values()), c.most_common(8), file=sys.stderr)
atexit.register(done)
script = sys.argv[1]
sys.argv = sys.argv[1:]
sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
runpy.run_path(script, run_name="__main__")
