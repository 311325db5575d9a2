import gc, os, runpy, sys
mode = os.environ.get("GCMODE", "off")
if mode == "off":
    gc.disable()
script = sys.argv[1]
sys.argv = sys.argv[1:]
sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
runpy.run_path(script, run_name="__main__")
