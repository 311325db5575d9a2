"""`python -m nereus.cli ...` runs `nereusc`; `python -m nereus.cli runtime ...` runs `nereus`."""

import sys

from nereus.cli import nereus, nereusc

if len(sys.argv) > 1 and sys.argv[1] == "runtime":
    del sys.argv[1]
    # usage lines say how to run it again (`python -m nereus.cli runtime train ...`)
    nereus(prog_name="python -m nereus.cli runtime")
else:
    nereusc(prog_name="python -m nereus.cli")
