"""An edge's calls: failover answers None and is counted; anything else raises (a wrong
signature once hid a membership refresh that never ran); work after a reply is kept and
its failures counted and logged."""
import asyncio
import logging

import pytest

from kdn.edge.peers import Peers
from kdn.core.errors import AccessDenied
from kdn.core.rpc import Unreachable


class Actors:
    def __init__(self, outcome):
        self.outcome, self.calls = outcome, []

    async def call(self, node, method, *args, timeout, **kw):
        self.calls.append((node, method, args, timeout))
        if isinstance(self.outcome, BaseException):
            raise self.outcome
        return self.outcome


def _peers(outcome):
    p = Peers("net", "admin-token-0123456789", edge="e")
    p.actors = Actors(outcome)
    return p


def test_an_unreachable_node_answers_none_and_is_counted_by_kind():
    p = _peers(Unreachable("gone"))
    assert asyncio.run(p.edge("far-0").peer_get([])) is None
    assert asyncio.run(p.origin().membership()) is None
    assert p.counters == {"peer_failures": 1, "origin_failures": 1}
    assert [c[3] for c in p.actors.calls] == [5.0, 20.0], "peers answer sooner than the origin"


@pytest.mark.parametrize("error", [TypeError("membership() got an unexpected keyword argument "
                                             "'token'"), AccessDenied("needs the admin token")])
def test_anything_else_raises(error):
    p = _peers(error)
    with pytest.raises(type(error)) as e:
        asyncio.run(p.origin().membership())
    assert e.value is error and p.counters == {}


def test_work_after_a_reply_is_kept_and_its_failure_counted_and_logged(caplog):
    p = _peers(None)

    async def fails():
        raise ValueError("repair refused")

    async def main():
        p.later(fails(), "read repair of far-0")
        assert len(p._tasks) == 1
        await asyncio.sleep(0.01)

    with caplog.at_level(logging.ERROR, logger="kdn.edge"):
        asyncio.run(main())
    assert p.counters == {"after_reply_errors": 1} and not p._tasks
    assert "read repair of far-0 failed: ValueError: repair refused" in caplog.text
