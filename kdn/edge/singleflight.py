"""Singleflight for asyncio: concurrent loads of one key cause one load.

When many workers miss the same chunk at once (a popular KB right after an edge restarts),
only the first caller loads it; the others await the same future. Loads are batched: a
caller hands over all the keys it misses and one loader call fetches those nobody else is
already loading (so a batch still costs one request per source, not one per key). A loader
that raises fails every caller waiting on its keys with that error.

Cancellation stays with the caller it was meant for. A caller cancelled while it waits
(a reader that hung up) leaves the load running for the others: it stops waiting, it never
cancels the shared future. A caller cancelled while it loads raises CancelledError itself,
and the keys it was loading are handed back: each waiting caller then joins the keys again,
so one of them loads them as the new loader (Go's singleflight never hands one caller's
cancellation to another either).

Counters (groupcache's Stats): loads, loader calls made; loads_deduped, keys that joined a
load already in flight instead of causing one; loads_abandoned, loads whose loader was
cancelled (their keys were loaded again by a waiting caller, if any).
"""
import asyncio
import collections

_ABANDONED = object()      # a future's result when its loader was cancelled: join again


class Group:
    def __init__(self):
        self._inflight = {}        # key -> asyncio.Future resolving to the value or None
        self.counters = collections.Counter()

    def __len__(self):
        return len(self._inflight)

    async def do_many(self, keys, loader) -> list:
        """Values for keys (None where the loader found nothing), loading each key once.

        loader(list_of_keys) is an async function returning {key: value} for keys it found.
        """
        got, todo = {}, list(keys)
        while todo:
            futures, mine = self._join(todo)
            if mine:
                await self._load(mine, loader)
            await asyncio.wait(futures)        # never cancels them: others wait on them too
            for k, f in zip(todo, futures):
                got[k] = f.result()            # the loader's error, if it raised one
            todo = [k for k in todo if got[k] is _ABANDONED]   # their loader was cancelled
        return [got[k] for k in keys]

    def _join(self, keys) -> tuple:
        """(a future per key, the keys this caller must load itself)."""
        loop = asyncio.get_running_loop()
        futures, mine = [], []
        for k in keys:
            f = self._inflight.get(k)
            if f is None:
                f = self._inflight[k] = loop.create_future()
                mine.append(k)
            else:
                self.counters["loads_deduped"] += 1
            futures.append(f)
        return futures, mine

    async def _load(self, keys, loader) -> None:
        self.counters["loads"] += 1
        try:
            found = await loader(keys)
        except asyncio.CancelledError:   # this caller's cancellation, not the waiters'
            self.counters["loads_abandoned"] += 1
            self._settle(keys, found={}, abandoned=True)
            raise
        except BaseException as e:   # every waiter gets the loader's error, then it propagates
            self._settle(keys, error=e)
            raise
        self._settle(keys, found=found)

    def _settle(self, keys, found=None, error=None, abandoned: bool = False) -> None:
        for k in keys:
            f = self._inflight.pop(k)
            if f.done():
                continue
            if error is not None:
                f.set_exception(error)
                f.exception()      # retrieved: the loading caller raises it itself
            else:
                f.set_result(_ABANDONED if abandoned else found.get(k))

    def stats(self) -> dict:
        return {"inflight": len(self._inflight), **self.counters}
