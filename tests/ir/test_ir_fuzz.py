"""Mutated sources never crash the front end: the result is a Module or a NereusError
whose text names a location inside the file and no internal token name."""

import re
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import nereus.ir as ir

SAMPLE = (Path(__file__).parent / "golden" / "sample.nir").read_text()
PIECES = ["{", "}", ",", "..", ":", "=", "->", "#", "\n", " ", "0", "-1", "n9", "n1:", "dp", "tp 3", "on",
          "plan", "model", "cluster", "workload", "transition", "actor.training", "4.5GB", "7%", "llama",
          "offload", "x.y", "héllo", "\t", "9" * 30, "0..", "..n3"]
INTERNAL = re.compile(r"__ANON|\bRBRACE\b|\bLBRACE\b|\bQUANTITY\b|MODEL_STAGE|GPU_ID|\$END|Token\(")


@st.composite
def mutated(draw):
    text = SAMPLE
    for _ in range(draw(st.integers(1, 3))):
        start = draw(st.integers(0, len(text)))
        end = min(len(text), start + draw(st.integers(0, 12)))
        insert = draw(st.one_of(st.sampled_from(PIECES), st.text(max_size=3)))
        text = text[:start] + insert + text[end:]
    return text


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(mutated())
def test_mutations_give_a_module_or_a_located_error(text):
    try:
        module = ir.parse_source(text, "m.nir")
    except ir.NereusError as error:
        message = error.format()
        assert not INTERNAL.search(message), message
        assert error.loc is not None and error.loc.file == "m.nir", message
        assert 1 <= error.loc.line <= max(1, text.count("\n") + 1), message
        return
    assert ir.parse_source(ir.print_module(module)) == module
