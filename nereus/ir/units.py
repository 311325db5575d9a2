"""Quantities with units: parsing `141GB`, `4.8TB/s`, `989TFLOPS`, `5%`, and printing
values back in the most readable exact unit.

Parsing is exact: the number is read as a Decimal and scaled, so `4.8TB/s` is exactly
4.8e12 bytes/s and `1.5GiB` exactly 1610612736 bytes. Printing picks the largest unit in
which the value is exact, at least 1 and has at most two decimals (else the shortest
exact text), so that `parse(format(x)) == x` for every value, floats included.
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation, localcontext
from typing import Optional

SIZE_UNITS: dict[str, int] = {
    "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
    "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40,
}
RATE_UNITS: dict[str, int] = {"B/s": 1, "KB/s": 10**3, "MB/s": 10**6, "GB/s": 10**9, "TB/s": 10**12}
FLOPS_UNITS: dict[str, int] = {"FLOPS": 1, "GFLOPS": 10**9, "TFLOPS": 10**12, "PFLOPS": 10**15}

_QUANTITY = re.compile(r"(-?[0-9]+(?:\.[0-9]+)?)(.*)")


class UnitError(ValueError):
    """A value that does not read as the quantity expected; carries a hint."""

    def __init__(self, message: str, hint: Optional[str] = None):
        super().__init__(message)
        self.message = message
        self.hint = hint


_EXPONENT = re.compile(r"[eE][-+]?[0-9]+")


def _split(text: str, what: str) -> tuple[Decimal, str]:
    match = _QUANTITY.fullmatch(text)
    if match is None:
        raise UnitError(f"{what} takes a number, found '{text}'")
    number, rest = Decimal(match.group(1)), match.group(2)
    exponent = _EXPONENT.match(rest)
    if exponent is not None:  # 1.6e1, 1e3GB: exponents are not quantities here
        value = Decimal(match.group(1) + exponent.group(0))  # the patterns make it a valid Decimal
        unit = rest[exponent.end():]
        digits = f"{value.normalize():f}{unit}" if abs(value.adjusted()) < 30 else "in digits"
        raise UnitError(f"{what} is written with digits, not an exponent: found {text}", f"write {what} {digits}")
    if match.group(1) in ("0", "-0") and rest[:1] in ("x", "X", "b", "B", "o", "O") and len(rest) > 1:
        other = _other_base(text)
        raise UnitError(f"{what} is a decimal number, found {text}", f"write {what} {other}" if other is not None else None)
    return number, rest


def _other_base(text: str) -> Optional[int]:
    try:
        return int(text, 0)
    except ValueError:
        return None


def _units_hint(units: dict[str, int]) -> str:
    return "units: " + ", ".join(units)


def parse_int(text: str, what: str, minimum: int = 1) -> int:
    """A whole number without unit, at least `minimum`."""
    number, unit = _split(text, what)
    if unit:
        raise UnitError(f"{what} takes a plain number, found unit '{unit}'", f"write {what} {number}")
    if number != number.to_integral_value():
        raise UnitError(f"{what} must be a whole number, found {text}",
                        f"write {what} {max(minimum, int(number.to_integral_value()))}")
    value = int(number)
    if value < minimum:
        raise UnitError(f"{what} must be at least {minimum}, found {value}", f"write {what} {minimum} or more")
    return value


def _scaled(text: str, what: str, units: dict[str, int], example: str) -> Decimal:
    number, unit = _split(text, what)
    if not unit:
        raise UnitError(f"{what} needs a unit", f"write it like {example}; {_units_hint(units)}")
    if unit not in units:
        raise UnitError(f"unknown unit '{unit}' for {what}", _units_hint(units))
    if number <= 0:
        raise UnitError(f"{what} must be positive, found {text}", f"write it like {example}")
    with localcontext() as context:
        context.prec = 80
        return number * units[unit]


def parse_size(text: str, what: str) -> int:
    """Bytes from `141GB`, `1.5GiB`, ...; must be a positive whole number of bytes."""
    value = _scaled(text, what, SIZE_UNITS, "141GB or 80GiB")
    if value != value.to_integral_value():
        raise UnitError(f"{what} {text} is not a whole number of bytes")
    return int(value)


def parse_rate(text: str, what: str) -> float:
    """Bytes per second from `900GB/s`, `4.8TB/s`, ..."""
    return float(_scaled(text, what, RATE_UNITS, "900GB/s"))


def parse_flops(text: str, what: str) -> float:
    """FLOP per second from `989TFLOPS`, ..."""
    return float(_scaled(text, what, FLOPS_UNITS, "989TFLOPS"))


RESERVE_HINT = "the share of each GPU's memory kept free, e.g. reserve 5%"


def parse_fraction(text: str, what: str) -> float:
    """A fraction in [0, 1) from `5%` or `0.05`."""
    number, unit = _split(text, what)
    if unit not in ("", "%"):
        raise UnitError(f"{what} takes a percentage, found unit '{unit}'", f"write it like {what} 5%")
    with localcontext() as context:
        context.prec = 80
        fraction = number / 100 if unit == "%" else number
    if not 0 <= fraction < 1:
        raise UnitError(f"{what} must be at least 0% and below 100%, found {text}", RESERVE_HINT)
    if float(fraction) >= 1:  # below 1 as written, 1.0 as a float: it would fail later as "100%"
        raise UnitError(f"{what} {text} is below 100% only past a float's precision",
                        f"write at most 15 significant digits, e.g. {what} 99.99%")
    return float(fraction)


def _decimal_text(value: Decimal) -> str:
    text = format(value.normalize(), "f")
    return text


def _best(value, units: dict[str, int]) -> str:
    """The most readable exact `{number}{unit}` for `value` (an int or float)."""
    try:
        exact = Decimal(value) if isinstance(value, int) else Decimal(repr(float(value)))
    except InvalidOperation:  # inf or nan: not a value any parser accepts
        raise ValueError(f"cannot print {value!r} as a quantity") from None
    candidates = []
    with localcontext() as context:
        context.prec = 80
        for unit, factor in units.items():
            number = exact / factor
            if number * factor != exact:
                continue
            text = _decimal_text(number)
            decimals = len(text.partition(".")[2])
            # Readable: the largest unit giving a number >= 1 with at most two decimals
            # (900GB/s not 0.9TB/s, 4.8TB/s not 4800GB/s, 1979.5TFLOPS not 1.9795PFLOPS);
            # failing that, the shortest text.
            readable = number >= 1 and decimals <= 2
            candidates.append((not readable, -factor if readable else len(text) + len(unit), -factor, text + unit))
    return min(candidates)[-1]


def format_size(value: int) -> str:
    """`141000000000` → `141GB`; `85899345920` → `80GiB`."""
    return _best(int(value), SIZE_UNITS)


def format_rate(value: float) -> str:
    """`4.8e12` → `4.8TB/s`."""
    return _best(value, RATE_UNITS)


def format_flops(value: float) -> str:
    """`9.89e14` → `989TFLOPS`."""
    return _best(value, FLOPS_UNITS)


def format_fraction(value: float) -> str:
    """`0.05` → `5%`."""
    with localcontext() as context:
        context.prec = 80
        return _decimal_text(Decimal(repr(float(value))) * 100) + "%"


_NUMBER = re.compile(r"[0-9]+(?:\.[0-9]+)?(?:[eE][-+]?[0-9]+)?")


def parse_positive_float(text: str, what: str) -> float:
    """A positive number without unit, in decimal or exponent form: `500000`, `1e-5`."""
    if not _NUMBER.fullmatch(text):
        number, unit = _split(text, what)
        if unit:
            raise UnitError(f"{what} takes a plain number, found unit '{unit}'", f"write it like {what} 1e-5")
        raise UnitError(f"{what} must be positive, found {text}")
    value = float(text)
    if value == 0 and Decimal(text) != 0:
        raise UnitError(f"{what} {text} is too small: it rounds to 0 as a float", f"write it like {what} 1e-5")
    if value <= 0:
        raise UnitError(f"{what} must be positive, found {text}")
    if value == float("inf"):
        raise UnitError(f"{what} is too large, found {text}")
    return value


def format_number(value: float) -> str:
    """The shortest text that `parse_positive_float` reads back as `value`: `500000`,
    `1e-5`, `0.5`, `1.5e-6`."""
    value = float(value)
    if value.is_integer() and abs(value) < 1e16:
        return str(int(value))
    mantissa, e, exponent = repr(value).partition("e")
    return mantissa + (f"e{int(exponent)}" if e else "")


def human_bytes(n: int) -> str:
    """A byte count for people, in binary units with one decimal: `352785678336` →
    `328.6 GiB`, `512` → `512 B`. Every user-facing text of Nereus uses this one unit
    system (the `.nir` sizes a user writes may be decimal or binary; exact byte counts
    appear only in JSON output)."""
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"
