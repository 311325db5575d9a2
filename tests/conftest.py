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
