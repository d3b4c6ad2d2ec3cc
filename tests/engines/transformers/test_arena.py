"""The rebuild arena: a buffer is lent for its owner's life and reused after it, never while an
owner can still read it; idle memory is bounded; what it lends has the shape and dtype asked."""
import gc
import threading

import pytest
import torch

from kdn.engines.transformers.arena import ROUND_BYTES, Arena
from kdn.core.errors import BadRequest


class Owner:
    """Stands for an engine cache: anything that can be weakly referenced."""


def test_a_buffer_is_reused_once_its_owner_is_gone():
    arena = Arena(refill=False)
    a = Owner()
    buf = arena.take((4, 1000), torch.float32, owner=a)
    assert buf.shape == (4, 1000) and buf.dtype == torch.float32 and buf.is_contiguous()
    buf.fill_(1.5)
    ptr = buf.data_ptr()
    del a, buf
    again = arena.take((2, 1000), torch.float32, owner=Owner())    # the owner dies at once
    assert again.data_ptr() == ptr, "the same faulted-in memory comes back"
    assert arena.counters["allocated"] == 1 and arena.counters["reused"] == 1


def test_a_live_owner_keeps_its_buffer_to_itself():
    arena = Arena(refill=False)
    owners = [Owner(), Owner()]
    bufs = [arena.take((1 << 20,), torch.float32, owner=o) for o in owners]
    for i, b in enumerate(bufs):
        b.fill_(i)
    assert bufs[0].data_ptr() != bufs[1].data_ptr()
    third = arena.take((1 << 20,), torch.float32, owner=Owner())     # while both live: fresh memory
    assert third.data_ptr() not in {b.data_ptr() for b in bufs}
    assert float(bufs[0][123]) == 0.0 and float(bufs[1][123]) == 1.0   # nobody wrote over them
    assert arena.counters["allocated"] == 3


def test_rebuilds_on_threads_never_share_a_buffer():
    arena = Arena(refill=False)
    seen, errors = [], []

    def rebuild(i):
        o = Owner()
        b = arena.take((256, 1024), torch.float32, owner=o)
        b.fill_(i)
        seen.append(b.data_ptr())
        if not bool((b == i).all()):
            errors.append(i)

    threads = [threading.Thread(target=rebuild, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and arena.counters["allocated"] + arena.counters["reused"] == 8


def test_idle_memory_stays_within_max_bytes():
    arena = Arena(max_bytes=2 * ROUND_BYTES, refill=False)
    owners = [Owner() for _ in range(4)]
    for o in owners:
        arena.take((ROUND_BYTES // 4,), torch.float32, owner=o)      # one ROUND_BYTES buffer each
    del owners, o
    gc.collect()
    st = arena.stats()
    assert st["idle_bytes"] <= 2 * ROUND_BYTES and st["idle_buffers"] == 2
    assert st["counters"]["released"] == 2


def test_the_smallest_fitting_buffer_is_lent_and_sizes_round_up():
    arena = Arena(refill=False)
    small, big = Owner(), Owner()
    arena.take((ROUND_BYTES + 1,), torch.uint8, owner=big)           # 2 x ROUND_BYTES
    arena.take((10,), torch.uint8, owner=small)                      # 1 x ROUND_BYTES
    assert arena.counters["allocated_bytes"] == 3 * ROUND_BYTES
    del small, big
    b = arena.take((100,), torch.bfloat16, owner=Owner())
    assert b.dtype == torch.bfloat16 and arena.stats()["idle_bytes"] == 3 * ROUND_BYTES


@pytest.mark.parametrize("bad", [-1, 1.5, True, "1G", None])
def test_max_bytes_must_be_a_size(bad):
    with pytest.raises(BadRequest, match="max_bytes"):
        Arena(max_bytes=bad)


def test_growing_caches_share_a_power_of_two_buffer_and_small_ones_never_take_a_big_one():
    from kdn.engines.transformers.arena import DOUBLING_BYTES, size_class
    assert size_class(1) == ROUND_BYTES and size_class(DOUBLING_BYTES) == DOUBLING_BYTES
    assert size_class(DOUBLING_BYTES + 1) == 2 * DOUBLING_BYTES
    assert size_class(200 << 20) == size_class(250 << 20) == 256 << 20    # turn after turn, one class
    arena = Arena(refill=False)
    first = Owner()
    arena.take((200 << 20,), torch.uint8, owner=first)
    del first
    gc.collect()
    arena.take((250 << 20,), torch.uint8, owner=Owner())                  # the next turn, a bit longer
    assert arena.counters["allocated"] == 1 and arena.counters["reused"] == 1
    gc.collect()
    arena.take((1 << 20,), torch.uint8, owner=Owner())                    # a small cache: its own
    assert arena.counters["allocated"] == 2


def test_a_loan_that_leaves_no_idle_buffer_of_its_class_has_one_faulted_in_behind_it():
    arena = Arena()                                                       # refill: the default
    owners = [Owner(), Owner()]
    first = arena.take((3 * ROUND_BYTES,), torch.uint8, owner=owners[0])   # nothing idle: fresh
    arena.settle()
    assert arena.counters["allocated"] == 1 and arena.counters["prefaulted"] == 1
    assert arena.stats()["idle_bytes"] == 3 * ROUND_BYTES               # the reserve, ready
    second = arena.take((3 * ROUND_BYTES,), torch.uint8, owner=owners[1])     # the next one waits for nothing
    assert arena.counters["reused"] == 1 and arena.counters["allocated"] == 1
    assert second.data_ptr() != first.data_ptr()
    arena.settle()
    assert arena.counters["prefaulted"] == 2                              # and the reserve is made again
    assert arena.counters["prefaulted_bytes"] == 6 * ROUND_BYTES


def test_the_reserve_stays_within_max_bytes():
    arena = Arena(max_bytes=2 * ROUND_BYTES)
    arena.take((3 * ROUND_BYTES,), torch.uint8, owner=Owner())            # a 4-round class: over the bound
    arena.settle()
    assert arena.counters["prefaulted"] == 0 and arena.stats()["idle_bytes"] <= 2 * ROUND_BYTES
