"""The `triton` marker: a test that runs the Triton pack kernels (under Triton's interpreter
on CPU, often in a subprocess) skips where triton is not installed. A CPU install of the
`test` extra has no Triton (it is the `gpu` extra); CI installs it (.ci/run)."""

import importlib.util

import pytest

HAS_TRITON = importlib.util.find_spec("triton") is not None


def pytest_runtest_setup(item):
    if item.get_closest_marker("triton") is not None and not HAS_TRITON:
        pytest.skip("triton is not installed: this test runs the pack kernels (pip install -e '.[gpu]')")
