"""Eviction policies (LRU, S3-FIFO) on their own: which key goes, and their counters."""
import pytest

from kdn.edge.eviction import LRU, S3FIFO, make_policy, policy_stats
from kdn.core.errors import CacheError


def test_s3fifo_ghost_sends_returning_key_to_main():
    p = S3FIFO(400)   # small target 40 bytes
    for k in "abcd":
        p.insert(k, 100)
    assert p.evict() == "a"               # never hit: evicted from small, remembered as ghost
    p.insert("a", 100)                    # returns: goes straight to main
    assert p.counters["ghost_hits"] == 1 and p.main_bytes == 100 and p.small_bytes == 300
    p.touch("b")
    assert p.evict() == "c"               # b was hit: promoted to main instead of evicted
    assert p.counters["promotions"] == 1 and "b" in p and "c" not in p

def test_s3fifo_main_lazy_promotion():
    p = S3FIFO(1000)
    p._freq.update(a=0, b=0); p._main.update(a=10, b=10); p.main_bytes = 20
    p.touch("a"); p.touch("a")
    assert p.evict() == "b"               # a (freq 2) reinserted at head, b evicted
    assert p._freq["a"] == 1
    assert p.evict() == "a"               # second pass: a's freq drained to 0
    assert p.evict() is None and len(p) == 0 and p.main_bytes == 0

def test_lru_policy_direct_and_make_policy():
    p = make_policy("lru", 10)
    assert isinstance(p, LRU)
    for k in "xyz":
        p.insert(k, 1)
    p.touch("x"); p.remove("y")
    assert [p.evict(), p.evict(), p.evict()] == ["z", "x", None]


def test_make_policy_names_the_choices():
    with pytest.raises(CacheError, match="unknown eviction policy 'mru'; choose one of: lru, s3fifo"):
        make_policy("mru", 10)
    with pytest.raises(CacheError, match="small_ratio must be in"):
        S3FIFO(10, small_ratio=1.0)


def test_policy_stats_carry_the_counters():
    p = S3FIFO(400)
    for k in "abcd":
        p.insert(k, 100)
    p.evict()
    p.insert("a", 100)
    assert policy_stats(p) == {"policy": "s3fifo", "policy_items": 4, "ghost_hits": 1}
    assert policy_stats(LRU(10)) == {"policy": "lru", "policy_items": 0}
