import os
import sys

# the gloo launcher of the runtime tests (runtime_helpers.spawn) and this folder's cases
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "runtime"))
sys.path.insert(0, os.path.dirname(__file__))
