"""Singleflight for asyncio: concurrent loads of one key cause one load.

When many workers miss the same chunk at once (a popular KB right after an edge restarts),
only the first caller loads it; the others await the same future. Loads are batched: a
caller hands over all the keys it misses and one loader call fetches those nobody else is
already loading (so a batch still costs one request per source, not one per key).
"""
import asyncio


class Group:
    def __init__(self):
        self._inflight = {}        # key -> asyncio.Future resolving to the value or None
        self.loads = 0             # loader calls made
        self.shared = 0            # keys that joined a load already in flight

    def __len__(self):
        return len(self._inflight)

    async def do_many(self, keys, loader) -> list:
        """Values for keys (None where the loader found nothing), loading each key once.

        loader(list_of_keys) is an async function returning {key: value} for keys it found.
        """
        loop = asyncio.get_running_loop()
        futures, mine = [], []
        for k in keys:
            f = self._inflight.get(k)
            if f is None:
                f = loop.create_future()
                self._inflight[k] = f
                mine.append(k)
            else:
                self.shared += 1
            futures.append(f)
        if mine:
            self.loads += 1
            try:
                found = await loader(mine)
            except BaseException as e:
                for k in mine:
                    f = self._inflight.pop(k)
                    if not f.done():
                        f.set_exception(e)
                raise
            for k in mine:
                f = self._inflight.pop(k)
                if not f.done():
                    f.set_result(found.get(k))
        return list(await asyncio.gather(*futures))
