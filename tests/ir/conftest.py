"""`pytest tests/ir --update-golden` (or NEREUS_UPDATE_GOLDEN=1) rewrites golden files."""

import os

import pytest


def pytest_addoption(parser):
    parser.addoption("--update-golden", action="store_true", default=False,
                     help="rewrite tests/ir/golden/*.canonical.nir from the printer's output")


@pytest.fixture
def update_golden(request) -> bool:
    return bool(request.config.getoption("--update-golden", default=False)) or \
        os.environ.get("NEREUS_UPDATE_GOLDEN") == "1"
