"""Calls between KDN's actors and from clients: one helper that fails over, and only then.

A call fails over — the caller tries the next owner, skips an edge for a while, retries the
origin — on exactly these: the actor is dead or restarting (Ray's RayActorError, with its
ActorDiedError and ActorUnavailableError), no actor has that name (never started, or
killed), it did not answer in time (GetTimeoutError, asyncio's TimeoutError), or an object
it handed out was lost with its node (ObjectLostError). Each becomes `Unreachable`.

Everything else raises to the caller. An error the remote raised on purpose (a KDNError:
AccessDenied, BadRequest, ...) arrives as that error, without Ray's remote traceback; any
other remote error (a TypeError from a wrong signature) arrives as Ray raised it, because
it is a bug. A broad `except` here once hid an edge's membership refresh that never ran:
the origin's `membership()` did not take the `token=` every call passes.

A handle is looked up once and cached. The lookup (ray.get_actor) is a blocking call to
Ray's GCS: an async caller makes it in a worker thread, one lookup per actor however many
calls wait for it, so re-resolving an actor after a failover never stalls the caller's loop.

Methods are named by attribute, never by a string: `Actors.edge(name)` and `Actors.origin()`
return a `Stub` of the node's interface (kdn.core.interfaces), whose call checks its
arguments against the interface's signature before anything is sent. Every KDN actor method
takes `token=` (the admin token for node-to-node calls, a tenant's read token for reads);
`Actors` passes the one it holds unless a call names another.
"""
import asyncio
import functools
import inspect

from kdn.core.errors import KDNError, NetworkError
from kdn.core.interfaces import EdgeAPI, OriginAPI, methods
from kdn.core.names import NAMESPACE, ORIGIN_NODE, actor_name


class Unreachable(NetworkError):
    """An actor is dead, restarting, missing or too slow: the caller fails over."""


def failover_errors() -> tuple:
    """The exceptions a call fails over on (Ray imported lazily: pure modules import this)."""
    import ray.exceptions as rex
    return (rex.RayActorError, rex.GetTimeoutError, rex.ObjectLostError, TimeoutError,
            Unreachable)


def remote_error(e: BaseException) -> BaseException:
    """The KDNError a remote method raised, as itself (not wrapped in Ray's RayTaskError
    with a remote traceback full of terminal escapes); any other error unchanged."""
    cause = getattr(e, "cause", None)
    return cause if isinstance(cause, KDNError) else e


@functools.lru_cache(maxsize=None)
def _signatures(api) -> dict:
    return {n: inspect.signature(f) for n, f in methods(api).items()}


class Stub:
    """A node interface's methods as attributes: `stub.have(keys)` checks the arguments
    against `api`'s signature (TypeError here, before anything is sent), then returns
    `send(method, args, kw)`: an awaitable, an answer or an object ref, as the transport
    that made the stub does. `token=` names another token than the transport's."""

    __slots__ = ("_api", "_send", "_label")

    def __init__(self, api, send, label: str):
        self._api, self._send, self._label = api, send, label

    def __getattr__(self, name):
        sig = _signatures(self._api).get(name)
        if sig is None:
            raise AttributeError(f"{self._label} has no method {name!r} ({self._api.__name__}, "
                                 f"kdn.core.interfaces)")
        send, label = self._send, self._label

        def call(*args, **kw):
            try:
                sig.bind(None, *args, **{k: v for k, v in kw.items() if k != "token"})
            except TypeError as e:
                raise TypeError(f"{label}.{name}(): {e}") from None
            return send(name, args, kw)
        call.__name__ = call.__qualname__ = name
        return call

    def __repr__(self):
        return f"<{self._api.__name__} of {self._label}>"


def resolve_refs(refs, timeout: float) -> list:
    """refs as objects: an edge's reply lists, per chunk, an object reference (zero-copy
    beside the edge) or the object itself, carried in the reply (a copy the edge received
    over HTTP and did not put in its node's store: kdn/edge/dataplane.py). One ray.get for
    all the references."""
    import ray
    at = [i for i, r in enumerate(refs) if isinstance(r, ray.ObjectRef)]
    out = list(refs)
    for i, obj in zip(at, ray.get([refs[i] for i in at], timeout=timeout) if at else ()):
        out[i] = obj
    return out


class Actors:
    """Handles of one network's named actors, by node: an edge's name, or ORIGIN_NODE.

    A handle is looked up once and cached; a call that fails over forgets it, so the next
    call looks the name up again (a restarted actor answers under the same name).
    """

    def __init__(self, network: str, token: str = None):
        self.network, self.token = network, token
        self._handles = {}
        self._lookups = {}         # node -> the lookup in flight (an asyncio future), async callers

    def label(self, node) -> str:
        return "the origin" if node is ORIGIN_NODE else f"edge {node!r}"

    # --- stubs: how callers call (the methods below are their transport) -------------------
    def edge(self, name: str, timeout: float = None, how: str = "call") -> EdgeAPI:
        """Edge `name`'s interface; see stub()."""
        return self.stub(name, timeout, how)

    def origin(self, timeout: float = None, how: str = "call") -> OriginAPI:
        """The origin's interface; see stub()."""
        return self.stub(ORIGIN_NODE, timeout, how)

    def stub(self, node, timeout: float = None, how: str = "call"):
        """node's interface, each method called as `how` says: "call" (awaitable, call()),
        "try" (awaitable, None when it fails over: try_call()), "sync" (the answer, for a
        plain caller: call_sync()) or "start" (an object ref, not waited for: start())."""
        if how != "start" and timeout is None:
            raise TypeError(f"a {how!r} stub needs a timeout")
        send = {"call": lambda m, a, k: self.call(node, m, *a, timeout=timeout, **k),
                "try": lambda m, a, k: self.try_call(node, m, *a, timeout=timeout, **k),
                "sync": lambda m, a, k: self.call_sync(node, m, *a, timeout=timeout, **k),
                "start": lambda m, a, k: self.start(node, m, *a, **k)}[how]
        return Stub(OriginAPI if node is ORIGIN_NODE else EdgeAPI, send, self.label(node))

    def handle(self, node):
        h = self._handles.get(node)
        if h is None:
            import ray
            name = actor_name(self.network, node)
            try:
                h = ray.get_actor(name, namespace=NAMESPACE)
            except ValueError:
                raise Unreachable(f"no actor {name!r} in Ray namespace {NAMESPACE!r}: is "
                                  f"network {self.network!r} up?") from None
            self._handles[node] = h
        return h

    async def handle_async(self, node):
        """handle() for an async caller: a lookup runs in a worker thread, shared by every
        caller that wants that node's handle meanwhile."""
        h = self._handles.get(node)
        if h is not None:
            return h
        lookup = self._lookups.get(node)
        if lookup is None:
            lookup = self._lookups[node] = asyncio.ensure_future(asyncio.to_thread(self.handle, node))

            def done(f):         # the next lookup (after a failover) starts afresh
                if self._lookups.get(node) is f:
                    del self._lookups[node]
            lookup.add_done_callback(done)
        return await asyncio.shield(lookup)     # a caller that gives up leaves it to the others

    def forget(self, node) -> None:
        self._handles.pop(node, None)

    def _remote(self, node, method, args, kw):
        kw.setdefault("token", self.token)
        return getattr(self.handle(node), method).remote(*args, **kw)

    def _failed(self, node, method, e) -> Unreachable:
        self.forget(node)
        if isinstance(e, Unreachable):
            return e
        return Unreachable(f"{self.label(node)} of network {self.network!r} did not answer "
                           f"{method}: {type(e).__name__}")

    async def _call(self, node, method, args, kw):
        kw.setdefault("token", self.token)
        return await getattr(await self.handle_async(node), method).remote(*args, **kw)

    async def call(self, node, method, /, *args, timeout: float, **kw):
        """The answer of node's method; Unreachable when the call fails over. timeout bounds
        the handle's lookup too."""
        import ray.exceptions as rex
        try:
            return await asyncio.wait_for(self._call(node, method, args, kw), timeout)
        except rex.RayTaskError as e:
            raise remote_error(e) from None
        except failover_errors() as e:
            raise self._failed(node, method, e) from None

    async def try_call(self, node, method, /, *args, timeout: float, **kw):
        """call(), but None when it fails over (the caller moves to its next source)."""
        try:
            return await self.call(node, method, *args, timeout=timeout, **kw)
        except Unreachable:
            return None

    def call_sync(self, node, method, /, *args, timeout: float, **kw):
        """call() from a plain (non-async) caller: a driver, a worker, the CLI."""
        import ray
        import ray.exceptions as rex
        try:
            return ray.get(self._remote(node, method, args, kw), timeout=timeout)
        except rex.RayTaskError as e:
            raise remote_error(e) from None
        except failover_errors() as e:
            raise self._failed(node, method, e) from None

    def get_sync(self, node, refs, timeout: float):
        """The object of a reference node handed out, or the objects of a reply's list of
        them (resolve_refs), failing over like a call."""
        import ray
        try:
            return resolve_refs(refs, timeout) if isinstance(refs, list) else ray.get(refs, timeout=timeout)
        except failover_errors() as e:
            raise self._failed(node, "a transfer", e) from None

    def start(self, node, method, /, *args, **kw):
        """node's method called and not waited for: its object ref, so that calls to many
        nodes are in flight at once; get_sync(node, ref) collects each. Unreachable when node
        has no actor."""
        return self._remote(node, method, args, kw)
