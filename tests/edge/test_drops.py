"""An edge's replay of the origin's drop log (kdn/edge/drops.py), on a real EdgeNode and its
real tiers (the disk tier included) outside Ray, the origin's answers coming from a real
kdn/origin/drops.py log: a key dropped while the edge was away is dropped when it catches up, its
position survives a restart on its disk, and when the position is lost or does not follow,
only copies that may be stale go. A drop wins over every copy on its way in
(kdn/edge/tombstones.py): a pull from the origin, a disk read, a write-back and a push that
were under way when it came are neither served nor kept, an owner behind the asker answers
nothing, and the key's new bytes, stored after the drop, are. On a real network: `kdn
delete` and `kdn collect` reach every edge, and a republish reads its own bytes (the last
test; tests/multinode/test_drop_races.py races them with readers)."""
import asyncio
import json

import pytest

from kdn.core.errors import BadRequest
from kdn.core.names import ORIGIN_NODE
from kdn.edge.drops import POSITION_FILE
from kdn.edge.peers import Peers
from kdn.origin.drops import DropLog
from kdn.origin.objects import LocalObjects


class Origin:
    """The origin's `drops` call (kdn/origin/node.py) over a real log, and its `get_chunks` from
    `chunks` (read when asked; answered once `gate` is set, when there is one: a read in
    flight); down=True: unreachable. Other edges never answer."""

    def __init__(self, root):
        self.log = DropLog(LocalObjects(root))
        self.down = False
        self.chunks, self.gate = {}, None

    origin, edge = Peers.origin, Peers.edge        # stubs over ask(), as an edge's Peers has

    async def ask(self, node, method, *args, timeout=None, **kw):
        if self.down or node is not ORIGIN_NODE:
            return None
        if method == "get_chunks":
            got = [self.chunks.get(k) for k in args[0]]
            if self.gate is not None:
                await self.gate.wait()
            return got
        assert method == "drops"
        since = args[0] if args else None
        if since is None:
            return {**self.log.state(), "keys": None}
        keys, head = self.log.since(since)
        return {"log": self.log.id, "head": head, "keys": keys}


def edge_on(kit, origin, disk_dir, chunks=()):
    e = kit.local_edge(disk_bytes=64 << 20, disk_dir=str(disk_dir))
    e.node_id = "unit"                                # as inside Ray: it catches up by itself
    e.peers.ask = origin.ask
    e.replay.peers = e.peers
    for c in chunks:
        e.tiers.put("main", c.key, kit.held(c))
    return e


def held(e, chunks) -> list:
    return [e.tiers.peek(c.key) is not None or c.key in e.tiers.disk for c in chunks]


def test_keys_dropped_while_away_go_and_the_position_survives_a_restart(kit, tmp_path):
    origin = Origin(tmp_path / "origin")
    a, b, c, d = kit.make_chunks(4)
    e = edge_on(kit, origin, tmp_path / "disk", [a, b, c])
    assert asyncio.run(e.replay.catch_up()) and e.replay.seen == (origin.log.id, 0)
    assert held(e, [a, b, c]) == [True] * 3, "a new edge holding only what came since drops nothing"
    assert e.tiers.disk.write(a) and e.tiers.disk.write(b) and e.tiers.disk.write(c)
    origin.log.append([b.key, d.key])                 # dropped while the edge heard nothing
    assert e.replay.behind(origin.log.state())
    assert asyncio.run(e.replay.catch_up())
    assert held(e, [a, b, c]) == [True, False, True] and e.replay.counters["drops_replayed"] == 1
    assert json.loads((tmp_path / "disk" / "here-0" / POSITION_FILE).read_text()) == origin.log.state()
    assert not e.replay.behind(origin.log.state())

    origin.log.append([c.key])                        # ... and again while it was down
    again = edge_on(kit, origin, tmp_path / "disk")   # restarted on its disk: a and c there
    assert held(again, [a, c]) == [True, True] and again.replay.seen == (origin.log.id, 2)
    assert asyncio.run(again.replay.catch_up())
    assert held(again, [a, c]) == [True, False], "only the key logged since its position"
    assert again.replay.counters["drops_resets"] == 0


def test_an_unreachable_origin_changes_nothing_and_a_later_ping_catches_up(kit, tmp_path):
    origin = Origin(tmp_path / "origin")
    a, b = kit.make_chunks(2)
    e = edge_on(kit, origin, tmp_path / "disk", [a, b])
    asyncio.run(e.replay.catch_up())
    origin.log.append([a.key])
    origin.down = True
    assert asyncio.run(e.replay.catch_up()) is False
    assert held(e, [a, b]) == [True, True], "an origin outage is what edges outlast"
    origin.down = False

    async def ping_then_wait():
        await e.ping(drops=origin.log.state())        # the origin's health ping starts it
        await e.replay._task
    asyncio.run(ping_then_wait())
    assert held(e, [a, b]) == [False, True]


def test_a_lost_position_drops_only_what_the_disk_kept_from_before(kit, tmp_path):
    origin = Origin(tmp_path / "origin")
    a, b, c = kit.make_chunks(3)
    first = edge_on(kit, origin, tmp_path / "disk")
    asyncio.run(first.replay.catch_up())
    assert first.tiers.disk.write(a) and first.tiers.disk.write(b)
    (tmp_path / "disk" / "here-0" / POSITION_FILE).write_text("{not json")   # unreadable: start over
    e = edge_on(kit, origin, tmp_path / "disk", [c])                # c came in this life
    assert e.replay.seen is None and e.replay.from_before == {a.key, b.key}
    asyncio.run(e.replay.catch_up())
    assert held(e, [a, b, c]) == [False, False, True] and e.replay.counters["drops_resets"] == 1
    assert e.replay.seen == (origin.log.id, 0)


@pytest.mark.parametrize("how", ["another store", "a store rebuilt", "trimmed"])
def test_a_position_that_does_not_follow_drops_every_copy(kit, tmp_path, how):
    origin = Origin(tmp_path / "origin")
    a, b = kit.make_chunks(2)
    e = edge_on(kit, origin, tmp_path / "disk", [a, b])
    origin.log.append([b"\x01" * 16] * 3)
    asyncio.run(e.replay.catch_up())
    if how == "another store":
        origin.log = DropLog(LocalObjects(tmp_path / "other-origin"))
    elif how == "a store rebuilt":
        e.replay.seen = (origin.log.id, 99)
    else:
        origin.log.max_kept = 1
        origin.log.append([b"\x02" * 16])
        origin.log.append([b"\x03" * 16])
        assert origin.log.oldest > 3
    asyncio.run(e.replay.catch_up())
    assert held(e, [a, b]) == [False, False] and e.replay.counters["drops_resets"] == 1
    assert e.replay.seen == (origin.log.id, origin.log.head)


def test_a_malformed_drop_state_is_refused_naming_it(kit, tmp_path):
    e = edge_on(kit, Origin(tmp_path / "origin"), tmp_path / "disk")
    for bad in ({"log": "x"}, {"log": 1, "head": 0}, {"log": "x", "head": -1}, {"log": "x", "head": True}, []):
        with pytest.raises(BadRequest, match="drops must be"):
            asyncio.run(e.ping(drops=bad))


# --- a drop wins over every copy on its way in ---------------------------------------------------
def other_bytes(kit, c):
    """A chunk of c's key with other bytes (another machine's KV for the same tokens)."""
    from kdn.core.chunk import Chunk
    return Chunk(c.key, c.ns, c.kv + 1.0, c.dtype)


def same(obj, c) -> bool:
    """Whether obj (a chunk, or a Held of one) holds c's bytes."""
    import numpy as np
    if hasattr(obj, "resolve"):                       # inside Ray when an earlier test started it
        obj = asyncio.run(obj.resolve())
    return np.array_equal(obj.kv, c.kv)


@pytest.mark.parametrize("how", ["catch-up", "broadcast"])
def test_a_pull_under_way_when_its_key_is_dropped_is_neither_served_nor_kept(kit, tmp_path, how):
    origin = Origin(tmp_path / "origin")
    (old,) = kit.make_chunks(1)
    new = other_bytes(kit, old)
    e = edge_on(kit, origin, tmp_path / "disk")
    assert e.name in e.members.owners([old.key])[0], "a copy pulled through is kept (refill)"

    async def race():
        await e.replay.catch_up()
        origin.chunks[old.key], origin.gate = old, asyncio.Event()
        reading = asyncio.ensure_future(e.fetch([old.key], kit.NS, resolve=True))
        await asyncio.sleep(0.05)                     # the origin has read the old bytes
        origin.log.append([old.key])                  # ... and then removed them
        origin.chunks.pop(old.key)
        if how == "catch-up":
            await e.replay.catch_up()
        else:                                         # the origin's delete broadcast
            await e.drop([old.key], drops=origin.log.state())
        origin.gate.set()
        got = await reading
        await asyncio.sleep(0.05)                     # what is kept after the reply
        return got
    got = asyncio.run(race())
    assert got["chunks"] == [] and not any(held(e, [old])), "the drop came after the read: it wins"
    assert e.all_counters()["drops_refused_stale"] >= 1

    origin.chunks[old.key], origin.gate = new, None   # stored again, other bytes
    asyncio.run(e.replay.catch_up())
    got = asyncio.run(e.fetch([old.key], kit.NS, resolve=True))
    assert [same(c, new) for c in got["chunks"]] == [True]
    assert same(e.tiers.peek(old.key), new), "the new bytes are kept"


def test_an_owner_behind_the_asker_answers_nothing_until_it_catches_up(kit, tmp_path):
    origin = Origin(tmp_path / "origin")
    (c,) = kit.make_chunks(1)
    e = edge_on(kit, origin, tmp_path / "disk", [c])
    asyncio.run(e.replay.catch_up())
    level = origin.log.state()
    origin.log.append([c.key])                        # a drop the asker applied, not yet this edge

    async def asked(state):
        got = await e.peer_get([c.key], drops=state)
        if e.replay._task is not None:
            await e.replay._task
        return got
    assert asyncio.run(asked(origin.log.state())) == [None], "its copy may predate the drop"
    assert e.counters["peer_get_behind"] == 1 and not any(held(e, [c])), "and it caught up"
    e.tiers.put("main", c.key, kit.held(other_bytes(kit, c)))    # stored again since
    got = asyncio.run(asked(origin.log.state()))
    assert got[0] is not None and e.counters["peer_get_behind"] == 1
    assert asyncio.run(asked(level))[0] is not None, "an asker behind it is answered"


def test_a_push_read_before_a_drop_is_not_kept_and_new_bytes_pushed_after_are(kit, tmp_path):
    origin = Origin(tmp_path / "origin")
    (old,) = kit.make_chunks(1)
    new = other_bytes(kit, old)
    e = edge_on(kit, origin, tmp_path / "disk")
    asyncio.run(e.replay.catch_up())
    read_at = origin.log.state()                      # the origin read the old bytes here
    origin.log.append([old.key])
    asyncio.run(e.replay.catch_up())
    assert asyncio.run(e.put_chunks([old], drops=read_at)) == 0 and not any(held(e, [old]))
    assert asyncio.run(e.put_chunks([new], drops=origin.log.state())) == 1
    assert same(e.tiers.peek(old.key), new)
    other_log = {"log": "another-log-0000", "head": 9}
    (c,) = kit.make_chunks(1, seed=5)
    assert asyncio.run(e.put_chunks([c], drops=other_log)) == 0, "a position of another log: unknown"


def test_a_write_back_under_way_when_its_key_is_dropped_never_lands_on_disk(kit, tmp_path, monkeypatch):
    import time as _time
    origin = Origin(tmp_path / "origin")
    a, b = kit.make_chunks(2)
    e = edge_on(kit, origin, tmp_path / "disk")
    asyncio.run(e.replay.catch_up())
    t, disk = e.tiers, e.tiers.disk
    write = disk.write

    def slow_write(obj):                              # the file is being written when the drop comes
        _time.sleep(0.2)
        return write(obj)
    monkeypatch.setattr(disk, "write", slow_write)

    async def race():
        born = t.tombs.birth()
        assert t.write_back(kit.held(a), born=born)
        writing = asyncio.ensure_future(t.drain_write_backs(e.forms.intact))
        await asyncio.sleep(0.05)                     # a's file is being written
        await t.drop([a.key], at=t.tombs.position)    # waits for that write, then deletes it
        await writing
        return born
    born = asyncio.run(race())
    assert a.key not in disk and not disk.path(a.key).exists()
    t.tombs.dropped([b.key], t.tombs.position)        # a fill of a load born before b's drop
    assert not t.write_back(kit.held(b), born=born) and b.key not in t.pending


def test_a_disk_read_under_way_when_its_key_is_dropped_is_not_promoted(kit, tmp_path, monkeypatch):
    import time as _time
    origin = Origin(tmp_path / "origin")
    (c,) = kit.make_chunks(1)
    e = edge_on(kit, origin, tmp_path / "disk")
    asyncio.run(e.replay.catch_up())
    t = e.tiers
    assert t.disk.write(c)
    read = t.disk.read

    def slow_read(key, ns=None):                      # read before the drop, returned after it
        obj = read(key, ns)
        _time.sleep(0.2)
        return obj
    monkeypatch.setattr(t.disk, "read", slow_read)

    async def race():
        reading = asyncio.ensure_future(t.from_disk([c.key], kit.NS, ["main"]))
        await asyncio.sleep(0.05)
        await t.drop([c.key], at=t.tombs.position)
        return await reading
    assert asyncio.run(race()) == [None] and not any(held(e, [c]))


# --- on a real network: `kdn delete` and `kdn collect`, every edge replays, nothing stale ------
ADMIN = "drops-admin-token-0123456789abcdef"


def test_a_collect_is_replayed_by_every_edge_and_a_republish_reads_its_own_bytes(
        ray_cluster, small_network, synth, capsys, monkeypatch, tmp_path):
    import time
    import numpy as np
    import ray
    from kdn.cli import main
    from kdn.client import Client
    net = small_network(auth={"admin": ADMIN})
    monkeypatch.setenv("KDN_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("KDN_ADMIN_TOKEN", ADMIN)
    where = ["--address", ray_cluster.address, "--network", net.name]
    cl = Client(network=net.name, region="us-east", tenant="default", fingerprint="drops-test",
                admin_token=ADMIN)
    toks = synth.tokens(512, seed=3)
    cl.publish("gone", [("d", toks)], synth.kv(512, seed=1))
    keys = list(cl.manifest("gone").keys)

    def copies():
        return {e: ray.get(h.have.remote(keys, token=ADMIN), timeout=30) for e, h in net.edges.items()}
    t0 = time.monotonic()
    while sum(map(sum, copies().values())) < 2 * len(keys):      # two ring owners each
        assert time.monotonic() - t0 < 30, copies()
        time.sleep(0.2)
    assert main(["delete", "gone", "1", "--fingerprint", "drops-test", *where]) == 0
    assert "default/gone@v1 retired" in capsys.readouterr().out
    assert main(["collect", "--object-ttl", "-1", *where]) == 2    # refused, nothing collected
    assert "--object-ttl must be a number >= 0" in capsys.readouterr().err
    assert main(["collect", *where]) == 0
    assert capsys.readouterr().out.startswith(f"collected {len(keys)} chunks")
    t0 = time.monotonic()
    while any(map(any, copies().values())):          # collect broadcasts nothing: the log does it
        assert time.monotonic() - t0 < 20, copies()
        time.sleep(0.2)
    stats = [ray.get(h.stats.remote(token=ADMIN), timeout=30)["counters"] for h in net.edges.values()]
    assert sum(s["drops_replayed"] for s in stats) == 2 * len(keys)
    assert sum(s["drops_resets"] for s in stats) == 0
    other = synth.kv(512, seed=2)                    # the same keys, other bytes: another machine's
    cl.publish("gone", [("d", toks)], other)
    f = cl.fetch(toks, "gone")
    # bitwise on any CPU: the bytes this process published come back, nothing is computed
    assert f.tokens == 512 and np.array_equal(np.concatenate(f.kv_parts(), axis=3), other)
