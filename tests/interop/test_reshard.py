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
    import torch

    from interop_cases import build, full_state, optimizer, step
    from nereus.interop import reshard_module

    out = {}
    for source in LAYOUTS:
        src = build(source)
        src_optim = optimizer(src)
        for s in range(2):
            step(src, src_optim, s)
        expected = full_state(src, src_optim)
        losses = {}
        for target in LAYOUTS:
            if target == source:
                continue
            dst = build(target, meta=True)
            dst_optim = optimizer(dst)
            report = reshard_module(src, src_optim, dst, dst_optim)
            got = full_state(dst, dst_optim)
            differ = sorted(k for k in expected if not (torch.equal(got[k], expected[k]) if isinstance(got[k], torch.Tensor)
                                                       else got[k] == expected[k]))
            missing = sorted(set(expected) ^ set(got))
            # two steps: the second's loss shows that dst_optim updates dst's own parameters
            losses[target] = (step(dst, dst_optim, 2), step(dst, dst_optim, 3))
            out[(source, target)] = {"differ": differ, "missing": missing, "sent": report.bytes_sent,
                                     "bound": report.lower_bound_bytes, "verified": report.verified,
                                     "nir": report.nir if rank == 0 else None}
        reference = (step(src, src_optim, 2), step(src, src_optim, 3))
        for target, loss in losses.items():
            out[(source, target)]["loss"] = (loss, reference)
    return out


@pytest.fixture(scope="module")
def results():
    from runtime_helpers import spawn_ok

    return spawn_ok(_run, 4)


@pytest.mark.multiprocess
@pytest.mark.parametrize("source,target", PAIRS, ids=[f"{a}->{b}" for a, b in PAIRS])
def test_pair(results, source, target):
    for rank, found in enumerate(results):
        r = found[(source, target)]
        assert not r["missing"], f"rank {rank}: {r['missing'][:5]}"
        assert not r["differ"], f"rank {rank}: not bit-exact: {r['differ'][:5]}"
        assert r["verified"]
        assert r["sent"] <= r["bound"], (r["sent"], r["bound"])
        losses, references = r["loss"]
        for loss, reference in zip(losses, references):
            assert abs(loss - reference) <= 1e-5 * abs(reference), (losses, references)


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
