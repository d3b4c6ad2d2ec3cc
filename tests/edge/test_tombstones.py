"""Tombstones (kdn/edge/tombstones.py): a copy born before a drop of its key is stale, one born
after is not; positions only grow, through a reset too; tombstones go once old and passed,
the floor rising past them; an owner knows when an asker applied more of the log."""
import pytest

from kdn.core.errors import BadRequest
from kdn.edge.tombstones import Tombstones

K, J = b"k" * 16, b"j" * 16


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def test_a_copy_born_before_its_keys_drop_is_stale_and_one_born_after_is_not():
    t = Tombstones()
    t.start("L", 5)
    born = t.birth()                                  # a load starts: the edge is at 5
    t.dropped([K], [t.local(5)])                      # K logged at 5, applied while it runs
    assert t.stale(K, born) and not t.stale(J, born)
    t.advance("L", 6)
    assert not t.stale(K, t.birth()), "a load started after the drop: its bytes are the new ones"
    assert t.stale(K, t.born_at({"log": "L", "head": 5})), "a push read before the drop"
    assert not t.stale(K, t.born_at({"log": "L", "head": 6}))
    assert t.stale(J, t.born_at({"log": "other", "head": 9})), "another log: older than anything"
    assert not t.stale(K, None), "a copy made here"
    assert t.counters["drops_refused_stale"] == 3


def test_a_broadcast_drop_ahead_of_the_position_holds_until_the_catch_up_passes_it():
    clock = Clock()
    t = Tombstones(keep_s=10, clock=clock)
    t.start("L", 3)
    t.dropped([K], t.drop_position({"log": "L", "head": 7}))     # keys logged before 7
    assert t.stale(K, t.birth())
    clock.now += 60
    assert t.expire() == 0 and t.stale(K, t.birth()), "not passed yet: a load now may be stale"
    t.advance("L", 7)
    assert not t.stale(K, t.birth())
    assert t.expire() == 1 and len(t) == 0 and t.floor == t.local(7)
    assert t.stale(J, t.local(6)), "a load older than a forgotten tombstone is refused"


def test_tombstones_go_after_keep_s_and_the_floor_rises_past_them():
    clock = Clock()
    t = Tombstones(keep_s=10, clock=clock)
    t.start("L", 0)
    t.dropped([K, J], [0, 1])
    t.advance("L", 2)
    clock.now += 5
    assert t.expire() == 0 and len(t) == 2
    clock.now += 6
    assert t.expire() == 2 and len(t) == 0 and t.floor == 2
    assert not t.stale(K, t.birth()) and t.stale(K, 1)


def test_a_reset_fences_off_what_is_in_flight_and_positions_only_grow():
    t = Tombstones()
    t.start("L", 40)
    before = t.birth()
    t.fence()                                         # every copy in flight may be stale
    assert t.stale(J, before) and t.state() == {"log": "L", "head": 40}
    during = t.birth()
    t.dropped([K], t.position)
    assert t.stale(K, during) and not t.stale(J, during)
    t.restart("M", 3)                                 # another log, its head far below
    assert t.position > during and t.floor == t.position and len(t) == 0
    assert t.stale(J, during) and not t.stale(K, t.birth())
    assert t.state() == {"log": "M", "head": 3}
    t.advance("M", 5)
    assert t.state() == {"log": "M", "head": 5} and t.born_at({"log": "M", "head": 5}) == t.position


def test_an_owner_is_behind_an_asker_that_applied_more_of_its_log():
    t = Tombstones()
    assert t.behind({"log": "L", "head": 0}), "no position yet: behind anyone who has one"
    assert not t.behind(None)
    t.start("L", 4)
    assert not t.behind({"log": "L", "head": 4}) and not t.behind({"log": "L", "head": 2})
    assert t.behind({"log": "L", "head": 5}) and t.behind({"log": "M", "head": 0})
    with pytest.raises(BadRequest, match="drops must be"):
        t.behind({"log": "L", "head": -1})
