"""ReplicationPolicy: decay, promote/demote with hysteresis, the byte budget, owners, overrides."""
import math

import pytest

from kdn.core.errors import PlacementError
from kdn.placement import Decision, ReplicationPolicy

LN2 = math.log(2)


def policy(**kw):
    args = dict(half_life_s=10.0, promote_rate=1.0, demote_rate=0.1, hot_budget_fraction=0.5)
    args.update(kw)
    return ReplicationPolicy(**args)


def hit(pol, key, region, times, now=0.0, nbytes=10, kb=None):
    for _ in range(times):
        pol.record(key, region, nbytes, now=now, kb=kb)


def test_rate_is_a_decayed_count_with_the_half_life():
    pol = policy()
    hit(pol, b"k", "eu", 20)
    assert pol.rate(b"k", "eu", now=0) == pytest.approx(20 * LN2 / 10)
    assert pol.rate(b"k", "eu", now=10) == pytest.approx(10 * LN2 / 10)
    assert pol.rate(b"k", "us", now=0) == 0.0 and pol.rate(b"other", "eu", now=0) == 0.0
    pol.record(b"k", "eu", 10, now=10)                   # 10 decayed + 1 new
    assert pol.rate(b"k", "eu", now=10) == pytest.approx(11 * LN2 / 10)


def test_promote_above_threshold_keep_in_hysteresis_band_demote_when_cold():
    pol = policy()
    hit(pol, b"hot", "eu", 20)           # 1.39 req/s >= 1.0
    hit(pol, b"warm", "eu", 10)          # 0.69 req/s < 1.0
    d = pol.decide(now=0)
    assert d.promote == [(b"hot", "eu")] and d.demote == []
    assert pol.hot("eu") == {b"hot"} and pol.hot("us") == set()
    # at t=15 the rate is 0.49: below promote, above demote -> stays (no flapping)
    assert not pol.decide(now=15) and pol.hot("eu") == {b"hot"}
    # at t=40 the rate is 0.087 < 0.1 -> demoted
    d = pol.decide(now=40)
    assert d.demote == [(b"hot", "eu")] and pol.hot("eu") == set()
    s = pol.stats()
    assert s["promotions"] == 1 and s["demotions"] == 1 and s["cold"] == 1 and s["records"] == 30


def test_budget_keeps_the_hottest_and_displaces_only_much_colder_copies():
    pol = policy(region_capacity_bytes={"eu": 100})          # budget 50 bytes: two 20-byte copies
    for key, n in ((b"a", 40), (b"b", 30), (b"c", 20)):
        hit(pol, key, "eu", n, nbytes=20)
    d = pol.decide(now=0)
    assert sorted(d.promote) == [(b"a", "eu"), (b"b", "eu")]
    assert pol.hot_bytes("eu") == 40 <= pol.budget("eu") == 50
    assert pol.stats()["budget_refused"] == 1
    # d is hotter than c but not twice as hot as b: no displacement
    hit(pol, b"d", "eu", 50, now=0, nbytes=20)
    assert pol.decide(now=0).promote == [] and pol.hot("eu") == {b"a", b"b"}
    # e is more than twice as hot as b: b goes, e comes
    hit(pol, b"e", "eu", 70, now=0, nbytes=20)
    d = pol.decide(now=0)
    assert d.promote == [(b"e", "eu")] and d.demote == [(b"b", "eu")]
    assert pol.hot("eu") == {b"a", b"e"} and pol.hot_bytes("eu") == 40
    # capacity passed to decide() overrides the constructor's; a smaller budget sheds the coldest
    d = pol.decide(now=0, region_capacity_bytes={"eu": 40})
    assert d.demote == [(b"a", "eu")] and pol.hot("eu") == {b"e"}


def test_never_promote_where_an_owner_lives_and_drop_copies_that_became_redundant():
    pol = policy()
    for region in ("us", "eu", "ap"):
        hit(pol, b"k", region, 30)
    d = pol.decide(now=0, owners_region=lambda key: ["us", "ap"])
    assert d.promote == [(b"k", "eu")]
    d = pol.decide(now=0, owners_region=lambda key: "eu")        # the ring changed
    assert sorted(d.promote) == [(b"k", "ap"), (b"k", "us")] and d.demote == [(b"k", "eu")]
    assert pol.stats()["redundant"] == 1


def test_pins_promote_without_demand_never_demote_and_take_budget_first():
    pol = policy(region_capacity_bytes={"eu": 100})      # budget 50
    pol.register("handbook", [b"h1", b"h2", b"h3"], 10)
    o = pol.set_override("handbook", pin_regions=["eu"], replicas=3, prefetch=True)
    assert pol.override("handbook") == o and o.pin_regions == ("eu",) and pol.replicas("handbook") == 3
    assert pol.replicas("other", default=2) == 2
    hit(pol, b"x", "eu", 40, nbytes=15)
    hit(pol, b"y", "eu", 30, nbytes=15)
    d = pol.decide(now=0)
    assert set(d.promote) == {(b"h1", "eu"), (b"h2", "eu"), (b"h3", "eu"), (b"x", "eu")}
    assert pol.hot_bytes("eu") == 45 and pol.stats()["pinned"] == 3
    # an hour later nothing is requested: the demand-driven copy goes, the pins stay
    d = pol.decide(now=3600)
    assert d.demote == [(b"x", "eu")] and pol.hot("eu") == {b"h1", b"h2", b"h3"}
    assert pol.prefetch_keys("handbook") == {"eu": [b"h1", b"h2", b"h3"]}
    pol.clear_override("handbook")
    assert pol.override("handbook") is None and pol.prefetch_keys("handbook") == {}
    assert sorted(pol.decide(now=3600).demote) == [(b"h1", "eu"), (b"h2", "eu"), (b"h3", "eu")]


def test_ttl_demotes_idle_copies_of_its_kb_whatever_the_rate():
    pol = policy()
    pol.set_override("news", ttl_s=5)
    hit(pol, b"n", "eu", 100, kb="news")
    hit(pol, b"m", "eu", 100, kb="manual")
    assert sorted(pol.decide(now=0).promote) == [(b"m", "eu"), (b"n", "eu")]
    d = pol.decide(now=6)             # rate still ~9 req/s, but idle 6 s > ttl 5 s
    assert d.demote == [(b"n", "eu")] and pol.hot("eu") == {b"m"} and pol.stats()["expired"] == 1
    assert not pol.decide(now=7)                          # still idle: not promoted again
    hit(pol, b"n", "eu", 1, now=8, kb="news")             # requested again: hot again
    assert pol.decide(now=8).promote == [(b"n", "eu")]


def test_drop_forget_and_stats():
    pol = policy(forget_below=0.1)
    hit(pol, b"k", "eu", 30, nbytes=7)
    hit(pol, b"once", "eu", 1)
    pol.decide(now=0)
    assert pol.hot_bytes("eu") == 7
    pol.drop(b"k", "eu")
    assert pol.hot("eu") == set() and pol.hot_bytes("eu") == 0 and pol.stats()["dropped"] == 1
    pol.drop(b"k", "eu")                                   # already gone: nothing
    assert pol.stats()["dropped"] == 1
    pol.decide(now=60)                   # 'once' decayed to 0.016 requests, 'k' to 0.47: kept
    s = pol.stats()
    assert s["forgotten"] >= 1 and s["tracked"] == 1 and s["keys"] == 2 and s["decisions"] == 2
    assert isinstance(Decision(), Decision) and not Decision()


def test_bad_settings_are_refused_with_the_value():
    with pytest.raises(PlacementError, match="half_life_s must be > 0, got 0"):
        ReplicationPolicy(half_life_s=0)
    with pytest.raises(PlacementError, match=r"demote_rate must be in \[0, promote_rate=1.0\], got 2"):
        ReplicationPolicy(promote_rate=1.0, demote_rate=2)
    with pytest.raises(PlacementError, match="hot_budget_fraction must be in"):
        ReplicationPolicy(hot_budget_fraction=1.5)
    pol = ReplicationPolicy()
    with pytest.raises(PlacementError, match="prefetch needs pin_regions"):
        pol.set_override("kb", prefetch=True)
    with pytest.raises(PlacementError, match="replicas must be an int >= 1, got 0"):
        pol.set_override("kb", replicas=0)
    with pytest.raises(PlacementError, match="ttl_s must be > 0 seconds, got -1"):
        pol.set_override("kb", ttl_s=-1)
    with pytest.raises(PlacementError, match="nbytes must be an int >= 0, got -5"):
        pol.record(b"k", "eu", -5)
    with pytest.raises(PlacementError, match="keys must be bytes, got str"):
        pol.record("k", "eu", 5)
    with pytest.raises(PlacementError, match="2 sizes for 1 keys"):
        pol.register("kb", [b"k"], [1, 2])


def test_default_clock_is_used_when_now_is_omitted():
    t = [100.0]
    pol = ReplicationPolicy(half_life_s=10, promote_rate=1.0, clock=lambda: t[0])
    hit(pol, b"k", "eu", 20, now=None)
    assert pol.decide().promote == [(b"k", "eu")]
    t[0] = 110.0
    assert pol.rate(b"k", "eu") == pytest.approx(10 * LN2 / 10)
