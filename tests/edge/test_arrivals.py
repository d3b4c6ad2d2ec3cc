"""A store's objects kept as they arrived (kdn.edge.tiers.Held.arrival): a view into the
caller's argument in the node's object store, with no copy on the caller's time. What the
write-behind relies on: Ray keeps that memory while the edge maps it, after the caller has
freed it, after the caller's process is gone and while the store hands memory out again; and
adopt() makes it an object of the node's own with the same bytes, once (kdn.edge.arrivals)."""
import numpy as np
import ray

from kdn.core.keys import KEY_BYTES
from kdn.edge.tiers import INLINE_BYTES, Held
from kdn.integrations.objects import pack

NS = b"n" * KEY_BYTES
SIZE = 4 << 20


class Keeper:
    """An edge's part: keep each arriving object as it arrived; adopt on demand."""

    def __init__(self):
        self.held = []

    def keep(self, chunks) -> list:
        self.held += [Held.arrival(c) for c in chunks]
        return [bool(h.arrived) for h in self.held]

    def churn(self, n: int, size: int) -> int:
        """Allocate and free n objects of size in this node's store, as other writers would."""
        for i in range(n):
            ref = ray.put(np.full(size, 0xEE, np.uint8))
            del ref
        return n

    def digests(self) -> list:
        import xxhash
        return [xxhash.xxh3_64_hexdigest(np.asarray(h.obj.kv)) for h in self.held]

    def adopt(self) -> list:
        import xxhash
        for h in self.held:
            h.adopt(ray.put(h.obj))
        objs = ray.get([h.ref for h in self.held])
        return [h.obj is None for h in self.held], [h.arrived for h in self.held], \
            [xxhash.xxh3_64_hexdigest(np.asarray(o.kv)) for o in objs]


class Writer:
    """The caller: owns the objects it sends (as LMCache's process does)."""

    def send(self, keeper, seed: int, n: int) -> list:
        import xxhash
        rng = np.random.default_rng(seed)
        chunks = [pack(bytes([seed, i]) * (KEY_BYTES // 2), NS, rng.integers(0, 256, SIZE, dtype=np.uint8))
                  for i in range(n)]
        arrived = ray.get(keeper.keep.remote(chunks))
        return arrived, [xxhash.xxh3_64_hexdigest(np.asarray(c.kv)) for c in chunks]


def test_an_arrival_outlives_its_writer_and_the_stores_reuse_then_is_adopted_byte_equal(ray_cluster):
    assert SIZE >= INLINE_BYTES
    keeper = ray.remote(num_cpus=0)(Keeper).remote()
    writer = ray.remote(num_cpus=0)(Writer).remote()
    arrived, want = ray.get(writer.send.remote(keeper, 7, 3))
    assert arrived == [True, True, True]                # views, not copies
    ray.kill(writer)                                    # the owner of the arguments is gone
    ray.get(keeper.churn.remote(24, 16 << 20))          # the store reuses what was freed
    assert ray.get(keeper.digests.remote()) == want
    views_dropped, still, got = ray.get(keeper.adopt.remote())
    assert views_dropped == [True, True, True] and still == [False, False, False]
    assert got == want                                  # the node's own objects: the same bytes
    ray.kill(keeper)


def test_outside_ray_or_under_inline_bytes_an_arrival_is_an_ordinary_copy():
    small = pack(b"s" * KEY_BYTES, NS, np.arange(1024, dtype=np.uint8))
    held = Held.arrival(small)
    assert not held.arrived
    assert held.obj.kv.tobytes() == small.kv.tobytes()


def test_arrivals_are_adopted_once_after_the_answer_whoever_asks_first(ray_cluster, monkeypatch):
    """kdn.edge.arrivals.Arrivals: `later` counts the bytes still to copy until its task has
    put them; a reader's adopt of one meanwhile (a fetch about to answer) shares the lock, so
    each object is put once, counted under its own kind of arrival, and every adopted object
    is the bytes that arrived. A task that fails (run after the reply as the edge's own,
    Peers.later) leaves its arrivals for the next who asks."""
    import asyncio
    from kdn.edge import arrivals as A
    rng = np.random.default_rng(11)
    chunks = [pack(bytes([9, i]) * (KEY_BYTES // 2), NS, rng.integers(0, 256, SIZE, dtype=np.uint8))
              for i in range(4)]
    want = [c.kv.tobytes() for c in chunks]

    async def run():
        tasks = []
        arrivals = A.Arrivals(lambda coro, what: tasks.append(asyncio.get_running_loop().create_task(coro)))
        helds = [Held.arrival(c, kind) for c, kind in zip(chunks, ("store", "pushes", "pushes", "pushes"))]
        assert [h.arrived for h in helds] == ["store", "pushes", "pushes", "pushes"]
        arrivals.later(helds[:3])
        assert arrivals.pending_bytes == sum(h.nbytes for h in helds[:3]) > 3 * SIZE - 1
        await arrivals.adopt(helds[1:2])                 # a reader asks for one meanwhile
        while arrivals.pending_bytes:
            await asyncio.sleep(0.01)
        arrivals.later(helds[:3])                        # adopted already: nothing to do
        assert arrivals.pending_bytes == 0

        def broken(objs):
            raise RuntimeError("the store went away")
        monkeypatch.setattr(A, "_put_all", broken)
        arrivals.later(helds[3:])
        await asyncio.wait(tasks[-1:])
        assert "the store went away" in str(tasks[-1].exception()) and arrivals.pending_bytes == 0
        assert helds[3].arrived == "pushes" and helds[3].obj is not None      # left for the next
        monkeypatch.undo()
        await arrivals.adopt(helds[3:])
        return arrivals.counters, helds

    counters, helds = asyncio.run(run())
    assert (counters["store_adopted"], counters["pushes_adopted"]) == (1, 3), counters
    assert [h.arrived for h in helds] == [False] * 4 and all(h.obj is None for h in helds)
    assert [o.kv.tobytes() for o in ray.get([h.ref for h in helds])] == want
