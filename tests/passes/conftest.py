import os
import pathlib
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

# a transition whose program carries every header field (test_verify_strict_json.py,
# test_verify_header_fields.py)
EVERY_FIELD_NIR = pathlib.Path(__file__).parents[1] / "data" / "every-header-field.nir"


@pytest.fixture(scope="module")
def every_field_module():
    from nereus.ir import parse_file

    return parse_file(EVERY_FIELD_NIR)


@pytest.fixture(scope="module")
def every_field_program(every_field_module):
    from nereus.backends.json_program import program_json
    from nereus.passes import compile_transition

    return program_json(compile_transition(every_field_module, "S", "T"))
