"""Sizes, rates, FLOP rates and percentages: exact parsing, readable exact printing."""

import pytest

from nereus.ir import units


@pytest.mark.parametrize("text,value", [
    ("141GB", 141 * 10**9), ("80GiB", 80 * 2**30), ("1.5TiB", 3 * 2**39), ("2TB", 2 * 10**12),
    ("512B", 512), ("4KiB", 4096), ("1.25MB", 1_250_000),
])
def test_sizes(text, value):
    assert units.parse_size(text, "mem") == value
    assert units.format_size(value) == text


@pytest.mark.parametrize("text,value", [("4.8TB/s", 4.8e12), ("900GB/s", 9e11), ("12.5GB/s", 1.25e10),
                                        ("100MB/s", 1e8)])
def test_rates(text, value):
    assert units.parse_rate(text, "hbm") == value
    assert units.format_rate(value) == text


@pytest.mark.parametrize("text,value", [("989TFLOPS", 9.89e14), ("1979.5TFLOPS", 1.9795e15), ("2PFLOPS", 2e15),
                                        ("312GFLOPS", 3.12e11)])
def test_flops(text, value):
    assert units.parse_flops(text, "flops") == value
    assert units.format_flops(value) == text


def test_fractions():
    assert units.parse_fraction("5%", "reserve") == 0.05
    assert units.parse_fraction("0.05", "reserve") == 0.05
    assert units.format_fraction(0.07) == "7%"
    assert units.parse_fraction(units.format_fraction(0.07), "reserve") == 0.07
    assert units.format_fraction(0.125) == "12.5%"


@pytest.mark.parametrize("call,text,message", [
    (units.parse_size, "80", "mem needs a unit"),
    (units.parse_size, "0GB", "mem must be positive, found 0GB"),
    (units.parse_size, "0.5B", "mem 0.5B is not a whole number of bytes"),
    (units.parse_size, "8Gb", "unknown unit 'Gb' for mem"),
    (units.parse_rate, "8GB", "unknown unit 'GB' for mem"),
    (units.parse_int, "2.5", "mem must be a whole number, found 2.5"),
    (units.parse_int, "0", "mem must be at least 1, found 0"),
    (units.parse_int, "bf16", "mem takes a number, found 'bf16'"),
    (units.parse_fraction, "100%", "mem must be at least 0% and below 100%, found 100%"),
])
def test_errors(call, text, message):
    with pytest.raises(units.UnitError) as caught:
        call(text, "mem")
    assert caught.value.message == message


@pytest.mark.parametrize("call,text,message,hint", [
    (units.parse_int, "1.6e1", "batch is written with digits, not an exponent: found 1.6e1", "write batch 16"),
    (units.parse_int, "2.5e2", "batch is written with digits, not an exponent: found 2.5e2", "write batch 250"),
    (units.parse_int, "1e400", "batch is written with digits, not an exponent: found 1e400", "write batch in digits"),
    (units.parse_int, "0x10", "batch is a decimal number, found 0x10", "write batch 16"),
    (units.parse_int, "0b101", "batch is a decimal number, found 0b101", "write batch 5"),
    (units.parse_positive_float, "1e-400", "batch 1e-400 is too small: it rounds to 0 as a float",
     "write it like batch 1e-5"),
])
def test_hints_name_a_value_that_is_itself_valid(call, text, message, hint):
    """The hint for an exponent or another base writes the same number in digits (it
    said `write batch 1.6` for 1.6e1 and `write batch 0` for 0x10)."""
    with pytest.raises(units.UnitError) as caught:
        call(text, "batch")
    assert (caught.value.message, caught.value.hint) == (message, hint)
