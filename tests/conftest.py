"""Tests that run the Triton pack kernels (under Triton's interpreter on CPU, often in a
subprocess) skip where triton is not installed: tests/triton and the tests marked
`triton`. A CPU install of the `test` extra has no Triton (it is the `gpu` extra); CI
installs it (.ci/run)."""

import importlib.util
import pathlib

import pytest

TRITON_TESTS = pathlib.Path(__file__).resolve().parent / "triton"
# with tests/ on sys.path (pytest puts it there), tests/triton itself is found as a namespace
# package named triton: only a spec with an origin is Triton
_SPEC = importlib.util.find_spec("triton")
HAS_TRITON = _SPEC is not None and _SPEC.origin is not None


def pytest_runtest_setup(item):
    if HAS_TRITON:
        return
    if item.get_closest_marker("triton") is not None or TRITON_TESTS in pathlib.Path(item.path).resolve().parents:
        pytest.skip("triton is not installed: this test runs the pack kernels (pip install -e '.[gpu]')")



@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """`-n N` (xdist's "load") hands the tests out one by one: a module-scoped fixture then
    ran again in every worker that got one of its module's tests (a 4-process interop run
    twice, 60 s of CPU each). Here a file's tests go to one worker, the files in the order
    the workers collected them (see pytest_collection_modifyitems: the costly ones first,
    so that both workers end on short files and finish together). An explicit `--dist` is
    xdist's as usual. (`--dist loadgroup` would not do: xdist 3.8 renames a grouped test
    through an attribute pytest 9 no longer reads, so its groups are ignored.)"""
    if config.getvalue("dist") != "load":
        return None
    from xdist.scheduler import LoadFileScheduling

    config.option.loadscopereorder = False  # keep the collection's order, not the files' test counts
    return LoadFileScheduling(config, log)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """In an xdist worker: the files with tests marked multiprocess or slow first (their
    tests in their order), then the others, each group in collection order."""
    if not hasattr(config, "workerinput"):
        return
    costly = {item.path for item in items if any(item.get_closest_marker(m) for m in ("multiprocess", "slow"))}
    items.sort(key=lambda item: item.path not in costly)
