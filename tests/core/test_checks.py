"""The one number validator (kdn/core/checks.py): what passes, what is refused, and the message."""
import math
from fractions import Fraction

import numpy as np
import pytest

from kdn.core.checks import check_int, check_number
from kdn.core.errors import BadRequest, CacheError, KDNError


def test_ints_in_bounds_pass_as_ints():
    assert check_int(3, "n") == 3
    assert check_int(0, "n", 0) == 0 and check_int(5, "n", 1, 5) == 5
    assert check_int(-7, "n", hi=-7) == -7
    assert check_int(10**30, "n", 0) == 10**30          # no float conversion, no overflow


@pytest.mark.parametrize("value, lo, hi, text", [
    (True, None, None, "n must be an int, got True"),
    (False, 0, None, "n must be an int >= 0, got False"),
    (2.0, 1, None, "n must be an int >= 1, got 2.0"),
    ("3", 1, 3, "n must be an int in [1, 3], got '3'"),
    (None, None, 3, "n must be an int <= 3, got None"),
    (np.bool_(True), None, None, "n must be an int, got "),
    (np.int64(9), 1, None, "n must be an int >= 1, got "),           # would not pack: convert first
    (0, 1, None, "n must be an int >= 1, got 0"),
    (4, 1, 3, "n must be an int in [1, 3], got 4"),
    (10**100, 1, 3, "n must be an int in [1, 3], got 1000000000000000000000000000000000000000"),
])
def test_ints_refused_name_the_field_the_bound_and_the_value(value, lo, hi, text):
    with pytest.raises(BadRequest) as e:
        check_int(value, "n", lo, hi)
    assert str(e.value).startswith(text)


def test_numbers_pass_as_floats():
    assert check_number(1, "x") == 1.0 and type(check_number(1, "x")) is float
    assert check_number(0.5, "x", 0, 1) == 0.5 and check_number(0, "x", 0, 1) == 0.0
    assert check_number(np.float64(2.5), "x", open_lo=True, lo=0) == 2.5   # a float subclass
    assert check_number(1e6, "x", 0, 1e6, open_lo=True) == 1e6


@pytest.mark.parametrize("value, kw, text", [
    (True, {}, "x must be a number, got True"),
    ("1", {}, "x must be a number, got '1'"),
    (Fraction(1, 4), {}, "x must be a number, got Fraction(1, 4)"),
    (math.nan, {"lo": 0}, "x must be a number >= 0, got nan"),
    (math.inf, {}, "x must be a number, got inf"),
    (-math.inf, {"hi": 5}, "x must be a number <= 5, got -inf"),
    (10**400, {}, "x must be a number, got 1000"),                       # beyond any float
    (0, {"lo": 0, "open_lo": True}, "x must be a number > 0, got 0"),
    (0.0, {"lo": 0, "hi": 315360000.0, "open_lo": True}, "x must be a number in (0, 315360000], got 0.0"),
    (2.5, {"lo": 0, "hi": 2}, "x must be a number in [0, 2], got 2.5"),
    (-1e-3, {"lo": 0.5}, "x must be a number >= 0.5, got -0.001"),
])
def test_numbers_refused_name_the_field_the_bound_and_the_value(value, kw, text):
    with pytest.raises(BadRequest) as e:
        check_number(value, "x", **kw)
    assert str(e.value).startswith(text)


def test_a_callers_error_class_and_note():
    with pytest.raises(CacheError, match=r"^nbytes must be an int >= 0, got -1$"):
        check_int(-1, "nbytes", 0, error=CacheError)
    with pytest.raises(KDNError, match=r"^replicas must be an int in \[1, 2\] \(the network has 2 "
                                       r"edge\(s\)\), got 3$"):
        check_int(3, "replicas", 1, 2, note="the network has 2 edge(s)")
    with pytest.raises(ValueError, match=r"^w must be a number > 0, got -2$"):
        check_number(-2, "w", 0, open_lo=True, error=ValueError)


def test_long_values_are_cut_in_the_message():
    with pytest.raises(BadRequest) as e:
        check_int("z" * 1000, "name")
    assert len(str(e.value)) < 80
