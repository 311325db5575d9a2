"""nereus.interop.reshard_module on 4 gloo ranks: every ordered pair of the five layouts
of interop_cases (FSDP2, TP, both, in both mesh orders, replicated). For each source
layout: train 2 steps, reshard into every other layout (the source is only read), check
that every parameter, buffer and AdamW state's full tensor equals the source's bit for
bit, and that the bytes sent equal the compiler's owner-change bound; then two more steps
in each: the destination's losses equal the source's within 1e-5 relative (the second
shows that the destination's optimizer updates the destination's own parameters)."""

import pytest

from interop_cases import LAYOUTS

PAIRS = [(a, b) for a in LAYOUTS for b in LAYOUTS if a != b]


def _run(rank, world):
    from interop_cases import run_moves

    return run_moves(rank, [(a, [b for b in LAYOUTS if b != a]) for a in LAYOUTS])


@pytest.fixture(scope="module")
def results():
    from runtime_helpers import spawn_ok

    return spawn_ok(_run, 4)


@pytest.mark.multiprocess
@pytest.mark.parametrize("source,target", PAIRS, ids=[f"{a}->{b}" for a, b in PAIRS])
def test_pair(results, source, target):
    from interop_cases import check_move

    for found in results:
        check_move(found[(source, target)])


@pytest.mark.multiprocess
def test_report_nir_compiles_and_verifies_with_nereusc(results, tmp_path):
    """`report.nir` is an ordinary .nir file: the CLI compiles its src -> dst transition and
    verifies the program against it."""
    import subprocess
    import sys

    path = tmp_path / "reshard.nir"
    path.write_text(results[0][("fsdp2_tp2", "tp2_fsdp2")]["nir"])
    program = tmp_path / "p.json"
    for args in (["check", str(path)], [str(path), "--transition", "src:dst", "--emit", "json", "-o", str(program)],
                 ["verify", str(program), "--against", str(path)]):
        done = subprocess.run([sys.executable, "-m", "nereus.cli", *args], capture_output=True, text=True)
        assert done.returncode == 0, done.stderr
