"""Operator overrides: each value checked (no True, NaN, inf, absurd sizes) before any change."""
import math

import pytest

from kdn.core.errors import BadRequest
from kdn.core.manifest import MAX_TTL_S
from kdn.origin.overrides import kb_id, updated

REGIONS = ["us-east", "eu-west"]


def test_updated_changes_only_what_is_given():
    cur = {"replicas": 2}
    assert updated(cur, REGIONS, 3, ttl_s=60) == {"replicas": 2, "ttl_s": 60.0}
    assert cur == {"replicas": 2}
    assert updated({}, REGIONS, 3, pin_regions=("eu-west", "eu-west"), replicas=3, prefetch=False) == \
        {"pin_regions": ["eu-west"], "replicas": 3, "prefetch": False}
    assert updated({}, REGIONS, 0, replicas=1) == {"replicas": 1}          # no edges yet: 1 is fine
    assert updated({}, REGIONS, 3, ttl_s=MAX_TTL_S)["ttl_s"] == MAX_TTL_S
    assert kb_id("acme", "handbook") == "acme/handbook"


@pytest.mark.parametrize("kw", [
    {"replicas": True}, {"replicas": 0}, {"replicas": 4}, {"replicas": 1e12}, {"replicas": "2"},
    {"ttl_s": True}, {"ttl_s": math.nan}, {"ttl_s": -math.inf}, {"ttl_s": MAX_TTL_S * 2},
    {"ttl_s": -1}, {"ttl_s": "60"},
    {"pin_regions": ["mars"]}, {"pin_regions": "us-east"}, {"pin_regions": [1]}, {"pin_regions": {}},
    {"prefetch": 1},
])
def test_bad_values_are_refused(kw):
    with pytest.raises(BadRequest, match=next(iter(kw))):
        updated({}, REGIONS, 3, **kw)
