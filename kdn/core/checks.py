"""The one validator for numbers that arrive from outside: an int or a finite number in bounds.

Python's bool is an int (True == 1), so every hand-written check of a count needs a bool test
before its int test, and NaN fails every comparison, so a range test written as "refuse if
x < lo" lets it through. These two functions say it once, with one message shape that names
the field, the bound and the bad value:

    check_int(0, "replicas", 1, 3)      -> BadRequest: replicas must be an int in [1, 3], got 0
    check_number(nan, "ttl_s", 0, open_lo=True) -> BadRequest: ttl_s must be a number > 0, got nan

A caller whose problem has its own error class (ManifestError, CacheError, PlacementError,
...) passes it as `error=` (or any callable that makes the exception from the message, as
the chat API does for its 400s); `note=` adds why a bound is what it is.
"""
import math

from kdn.core.errors import BadRequest


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _bound(x) -> str:
    """A bound as a reader writes it: 315360000, not 3.1536e+08 or 315360000.0."""
    if isinstance(x, float) and x.is_integer() and abs(x) < 1e16:
        return str(int(x))
    return f"{x:g}" if isinstance(x, float) else str(x)


def _range(lo, hi, open_lo: bool) -> str:
    if lo is not None and hi is not None:
        return f" in {'(' if open_lo else '['}{_bound(lo)}, {_bound(hi)}]"
    if lo is not None:
        return f" {'>' if open_lo else '>='} {_bound(lo)}"
    if hi is not None:
        return f" <= {_bound(hi)}"
    return ""


def _refuse(value, what, kind, lo, hi, open_lo, error, note):
    note = f" ({note})" if note else ""
    return error(f"{what} must be {kind}{_range(lo, hi, open_lo)}{note}, got {value!r:.40}")


def check_int(value, what: str, lo=None, hi=None, *, error=BadRequest, note: str = "") -> int:
    """value when it is a Python int (never a bool) in [lo, hi] (a bound None: unbounded);
    `error` naming `what` and the value otherwise. What arrives from outside (JSON, msgpack,
    a config) holds Python ints; a caller with numpy integers converts them first, so what
    passes here also packs."""
    if not _is_int(value) \
            or lo is not None and value < lo or hi is not None and value > hi:
        raise _refuse(value, what, "an int", lo, hi, False, error, note)
    return value


def check_number(value, what: str, lo=None, hi=None, *, open_lo: bool = False,
                 error=BadRequest, note: str = "") -> float:
    """float(value) when value is a finite int or float (never a bool) in [lo, hi], or in
    (lo, hi] with open_lo; `error` naming `what` and the value otherwise."""
    try:
        as_float = float(value) if _is_int(value) or isinstance(value, float) else None
    except OverflowError:                  # an int beyond any float: not a finite number
        as_float = None
    if as_float is None or not math.isfinite(as_float) \
            or lo is not None and (value <= lo if open_lo else value < lo) \
            or hi is not None and value > hi:
        raise _refuse(value, what, "a number", lo, hi, open_lo, error, note)
    return as_float
