"""The edge memory tier: byte budget, eviction by policy, pinning, counters, threads."""
import threading

import numpy as np
import pytest

from kdn.edge.cache import ChunkCache
from kdn.edge.eviction import S3FIFO
from kdn.core.errors import CacheError, PinCapacityError


def arr(n, fill=1):
    return np.full(n, fill, dtype=np.uint8)


def test_byte_budget_and_lru_order():
    c = ChunkCache(300, policy="lru")
    for i, k in enumerate("abc"):
        assert c.put(k, arr(100, i))
    assert c.get("a")[0] == 0           # a becomes most recent; b is now the LRU
    assert c.put("d", arr(100, 3))
    assert "b" not in c and set(c.keys()) == {"a", "c", "d"}
    s = c.stats()
    assert (s["bytes"], s["items"], s["evictions"], s["capacity"], s["policy"]) == (300, 3, 1, 300, "lru")
    assert (s["gets"], s["hits"], s["misses"]) == (1, 1, 0)
    assert c.get("b") is None
    assert c.stats()["misses"] == 1


def test_variable_sizes_evict_until_it_fits():
    c = ChunkCache(1000)
    c.put("a", arr(400)); c.put("b", arr(400)); c.put("c", arr(100))
    assert c.put("big", arr(800))       # evicts a and b (oldest first); c + big = 900 fits
    assert set(c.keys()) == {"c", "big"}
    assert c.stats()["bytes"] == 900 and c.stats()["evictions"] == 2


def test_peek_changes_nothing():
    c = ChunkCache(200)
    c.put("a", arr(100)); c.put("b", arr(100))
    assert c.peek("a") is not None and c.peek("zz") is None
    c.put("c", arr(100))                # peek did not refresh a: a is evicted
    assert "a" not in c
    assert c.stats()["gets"] == 0


def test_oversized_value_rejected_and_nothing_evicted():
    c = ChunkCache(100)
    c.put("a", arr(60))
    assert c.put("huge", arr(101)) is False
    assert "a" in c and "huge" not in c
    s = c.stats()
    assert s["rejected"] == 1 and s["evictions"] == 0 and s["bytes"] == 60


def test_explicit_nbytes_and_unsizable_value():
    c = ChunkCache(100)
    assert c.put("k", object(), nbytes=40)
    assert c.stats()["bytes"] == 40
    with pytest.raises(CacheError, match="cannot size a object value"):
        c.put("x", object())
    with pytest.raises(CacheError, match="nbytes must be an int >= 0, got -1"):
        c.put("x", arr(1), nbytes=-1)


def test_replace_existing_key_updates_bytes():
    c = ChunkCache(100)
    c.put("a", arr(30)); c.put("a", arr(50, 7))
    assert len(c) == 1 and c.stats()["bytes"] == 50 and c.get("a")[0] == 7


def test_pinned_never_evicted():
    c = ChunkCache(300)
    c.put("p", arr(100), pin=True)
    for i in range(20):
        assert c.put(f"k{i}", arr(100))
    assert "p" in c and c.peek("p") is not None
    s = c.stats()
    assert s["pinned_items"] == 1 and s["pinned_bytes"] == 100 and s["bytes"] == 300
    # with 200 of 300 pinned, a 150-byte unpinned value cannot fit: refused, nothing evicted
    c.pin("k19")
    before = set(c.keys())
    assert c.put("wide", arr(150)) is False
    assert set(c.keys()) == before and c.stats()["rejected"] == 1
    c.unpin("k19")
    assert c.put("wide", arr(150))      # now k19 can be evicted
    assert "k19" not in c and "p" in c


def test_pin_beyond_capacity_is_refused_with_bytes_and_changes_nothing():
    c = ChunkCache(250)
    c.put("a", arr(100), pin=True); c.put("b", arr(100))
    with pytest.raises(PinCapacityError, match=r"cannot pin 160 bytes: 100 of 250 bytes are already pinned \(150 free"):
        c.put("c", arr(160), pin=True)
    assert set(c.keys()) == {"a", "b"} and c.stats()["pinned_bytes"] == 100
    c.pin("b")                          # pinning a cached chunk always fits: it is already counted
    assert c.stats()["pinned_items"] == 2


def test_pin_missing_key_and_discard():
    c = ChunkCache(100)
    with pytest.raises(CacheError, match="cannot pin 'nope': not in the cache"):
        c.pin("nope")
    with pytest.raises(CacheError, match="cannot unpin 'nope'"):
        c.unpin("nope")
    c.put("a", arr(10), pin=True)
    assert c.discard("a") is True and c.discard("a") is False
    s = c.stats()
    assert s["pinned_bytes"] == 0 and s["bytes"] == 0 and s["evictions"] == 0


def test_bad_policy_and_capacity():
    with pytest.raises(CacheError, match="unknown eviction policy 'mru'; choose one of: lru, s3fifo"):
        ChunkCache(10, policy="mru")
    with pytest.raises(CacheError, match="capacity_bytes must be an int >= 1, got 0"):
        ChunkCache(0)


def test_s3fifo_one_hit_wonders_leave_through_small_queue():
    # 10 slots: small share = 1 slot. Hot keys, hit while in small, move to main; a scan
    # of one-hit wonders then only churns the small queue.
    p = S3FIFO(1000)
    c = ChunkCache(1000, policy="s3fifo")
    assert p.small_target == 100
    hot = [f"h{i}" for i in range(8)]
    for k in hot:
        c.put(k, arr(100)); c.get(k)
    for i in range(50):
        k = f"scan{i}"
        if c.get(k) is None:
            c.put(k, arr(100))
    assert all(k in c for k in hot)
    lru = ChunkCache(1000, policy="lru")
    for k in hot:
        lru.put(k, arr(100)); lru.get(k)
    for i in range(50):
        lru.put(f"scan{i}", arr(100))
    assert not any(k in lru for k in hot)


@pytest.mark.parametrize("policy", ["lru", "s3fifo"])
def test_concurrent_threads_keep_accounting_exact(policy):
    c = ChunkCache(64 * 100, policy=policy)
    c.put("pinned", arr(100), pin=True)
    rng_keys = [f"k{i}" for i in range(300)]
    errors = []

    def worker(seed):
        rng = np.random.default_rng(seed)
        try:
            for _ in range(2000):
                k = rng_keys[int(rng.integers(0, len(rng_keys)))]
                if c.get(k) is None:
                    c.put(k, arr(100))
                if rng.random() < 0.02:
                    c.discard(k)
        except Exception as e:  # surfaced below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    s = c.stats()
    assert s["bytes"] == 100 * len(c) <= 6400
    assert s["gets"] == 8000 and s["hits"] + s["misses"] == 8000
    assert "pinned" in c and s["pinned_bytes"] == 100
    assert len(c._policy) == len(c) - 1   # every unpinned entry is known to the policy


def test_a_value_the_caller_refuses_is_a_miss_and_keeps_its_place():
    c = ChunkCache(300, policy="lru")
    c.put("a", arr(100, 1)); c.put("b", arr(100, 2))
    assert c.get("a", accept=lambda v: v[0] == 9) is None      # held, but not for this caller
    s = c.stats()
    assert (s["gets"], s["hits"], s["misses"]) == (1, 0, 1)
    c.put("c", arr(100, 3)); c.put("d", arr(100, 4))
    assert "a" not in c, "a refused get must not refresh recency"
    assert c.get("b", accept=lambda v: v[0] == 2)[0] == 2
    assert c.counters["hits"] == 1 and c.stats()["hit_ratio"] == 0.5


def test_stats_carry_the_counters_and_the_policy():
    c = ChunkCache(200, policy="s3fifo")
    for k in "abc":
        c.put(k, arr(100))
    s = c.stats()
    assert s["puts"] == 3 and s["evictions"] == 1 and s["items"] == 2 and s["bytes"] == 200
    assert s["policy"] == "s3fifo" and s["policy_items"] == 2
