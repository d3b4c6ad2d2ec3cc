"""Stand-in edges for the origin's unit tests (fixture `edges`): kdn.core.rpc.Actors' interface,
in one process.

The origin meets its edges only through `call(node, method, *args, timeout, **kw)` (and
try_call, forget); these edges answer the methods the origin calls and record every call.
`dead` edges fail over (Unreachable) as a dead actor would.
"""
import collections

import pytest

from kdn.core.rpc import Actors, Unreachable


class Edge:
    def __init__(self, name):
        self.name = name
        self.held = {}              # key -> what was pushed (a Chunk or an Encoded)
        self.pinned = set()
        self.ttl = {}               # key -> seconds
        self.version = 0
        self.membership = None
        self.manifests = []
        self.drops = None           # the drop log's state the last ping carried
        self.pushed_at = self.dropped_at = None     # ... the last push, the last drop carried

    def ping(self, drops=None, conversation_policies=None):
        self.drops = drops
        self.conversation_policies = conversation_policies
        return {"role": "edge", "name": self.name}

    def have(self, keys, ns=None):
        return [k in self.held for k in keys]

    def put_chunks(self, chunks, role="main", pin=False, ttl_s=None, drops=None):
        self.pushed_at = drops      # the drop log's settled state the bytes were read at
        n = 0
        for c in chunks:
            if c is None:
                continue
            self.held[c.key] = c
            n += 1
            if pin:
                self.pinned.add(c.key)
            if ttl_s:
                self.ttl[c.key] = ttl_s
        return n

    def drop(self, keys, drops=None):
        self.dropped_at = drops     # the drop log's settled state after the removal
        gone = [k for k in keys if self.held.pop(k, None) is not None]
        return len(gone)

    def pin_keys(self, keys):
        self.pinned.update(k for k in keys if k in self.held)
        return len(keys)

    def set_ttl(self, keys, ttl_s):
        hit = [k for k in keys if k in self.held]
        self.ttl.update(dict.fromkeys(hit, ttl_s))
        return len(hit)

    def set_membership(self, m):
        if m["version"] >= self.version:
            self.version, self.membership = m["version"], m
        return self.version

    def membership_of(self):
        return {"version": self.version}

    def add_manifest(self, m):
        self.manifests.append(m)

    def drop_manifest(self, ns, name, version):
        self.manifests = [m for m in self.manifests if (m["name"], m["version"]) != (name, version)]


class Edges:
    """Actors for a set of named Edge objects; `calls` lists (edge, method, token)."""

    def __init__(self, names, token=None):
        self.edges = {n: Edge(n) for n in names}
        self.token = token
        self.dead = set()
        self.calls = []
        self.forgotten = []

    def count(self, method) -> collections.Counter:
        return collections.Counter(e for e, m, _ in self.calls if m == method)

    async def call(self, node, method, *args, timeout, **kw):
        token = kw.pop("token", self.token)
        self.calls.append((node, method, token))
        if node in self.dead or node not in self.edges:
            raise Unreachable(f"edge {node!r} did not answer {method}")
        edge = self.edges[node]
        fn = edge.membership_of if method == "membership" else getattr(edge, method)
        return fn(*args, **kw)

    async def try_call(self, node, method, *args, timeout, **kw):
        try:
            return await self.call(node, method, *args, timeout=timeout, **kw)
        except Unreachable:
            return None

    def forget(self, node):
        self.forgotten.append(node)

    label, stub, edge, origin = Actors.label, Actors.stub, Actors.edge, Actors.origin


@pytest.fixture
def edges():
    """Edges(names, token=None): stand-in edges answering as kdn.core.rpc.Actors would."""
    return Edges


@pytest.fixture(scope="module")
def s3():
    """A real S3-compatible server on loopback (moto's threaded server, credentials checked),
    started once per module: .url(prefix), .env (the AWS_* variables), .endpoint."""
    from kdn.testing.s3 import LocalS3
    server = LocalS3()
    yield server
    server.stop()


@pytest.fixture
def bucket(s3):
    """s3://bucket/<a prefix of this test's own>, and the settings that reach it."""
    import types
    import uuid
    return types.SimpleNamespace(url=s3.url(f"t-{uuid.uuid4().hex[:8]}"), env=dict(s3.env), s3=s3)
