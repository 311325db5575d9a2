"""examples/interop_fsdp.py runs as README prints it (torchrun, 4 gloo processes): FSDP2
dp 2 x TP 2 -> TP 4 -> FSDP 4 with training between, its losses equal to a run that never
moved (the example exits 1 otherwise)."""

import os
import pathlib
import re
import shlex
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.mark.multiprocess
def test_readme_example_runs_under_torchrun():
    (line,) = re.findall(r"^(torchrun --standalone [^#\n]*interop_fsdp\.py)", (ROOT / "README.md").read_text(),
                         re.MULTILINE)
    command = line.strip().replace("torchrun", f"{shlex.quote(sys.executable)} -m torch.distributed.run", 1)
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH"))))}
    done = subprocess.run(command, shell=True, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "-> tp4:" in done.stdout and "-> fsdp4:" in done.stdout
    worst = float(re.search(r"largest relative difference (\S+)", done.stdout).group(1))
    assert worst <= 1e-5
