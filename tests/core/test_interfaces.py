"""The node interfaces (kdn.core.interfaces) are the nodes' methods, exactly, and a stub
checks a call against them before anything is sent."""
import asyncio
import inspect

import pytest

from kdn.core.interfaces import EdgeAPI, EdgeReads, OriginAPI, methods
from kdn.core.rpc import Stub
from kdn.edge.node import EdgeNode
from kdn.origin.node import OriginNode

# Public methods of the node classes that only the actor itself calls.
LOCAL = {EdgeNode: {"store_codec", "all_counters", "http_address", "peer_held", "conversation_prefix"},
         OriginNode: set()}


def _class(actor):
    return getattr(actor, "__ray_actor_class__", actor)


def _params(fn) -> list:
    """(name, kind, default) per parameter (not what Ray's tracing adds to actor methods)."""
    return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()
            if not p.name.startswith("_ray")]


@pytest.mark.parametrize("node,api", [(EdgeNode, EdgeAPI), (OriginNode, OriginAPI)])
def test_each_interface_method_is_the_nodes_method_with_the_same_parameters(node, api):
    cls = _class(node)
    declared = methods(api)
    public = {n for n, f in inspect.getmembers(cls, inspect.isfunction) if not n.startswith("_")}
    assert public - LOCAL[node] == set(declared), "a node method missing from its interface, or gone"
    for name, fn in declared.items():
        impl = getattr(cls, name)
        assert inspect.iscoroutinefunction(impl) == inspect.iscoroutinefunction(fn), name
        got = [p for p in _params(impl) if p[0] != "token"]
        assert got == _params(fn), f"{node.__name__}.{name}: {got} != {_params(fn)}"
        assert "token" in inspect.signature(impl).parameters, f"{name} takes no token="


def test_the_readers_part_is_part_of_the_edge():
    assert set(methods(EdgeReads)) == {"list_manifests", "lookup", "fetch", "drop_corrupt"}
    assert set(methods(EdgeReads)) <= set(methods(EdgeAPI))


def test_a_stub_checks_the_arguments_before_sending_and_passes_a_token():
    sent = []
    stub = Stub(EdgeAPI, lambda m, a, k: sent.append((m, a, k)) or "answer", "edge 'e1'")
    assert stub.have([b"k" * 16], token="t") == "answer"
    assert sent == [("have", ([b"k" * 16],), {"token": "t"})]
    with pytest.raises(TypeError, match=r"edge 'e1'\.lookup\(\).*no_such"):
        stub.lookup([], b"n" * 16, no_such=1)
    with pytest.raises(TypeError, match=r"edge 'e1'\.put_conversation\(\)"):
        stub.put_conversation([], "acme")            # missing fingerprint and scope
    with pytest.raises(AttributeError, match="no method 'commit' .*EdgeAPI"):
        stub.commit({})                              # the origin's, not an edge's
    assert len(sent) == 1, "nothing was sent for a call that does not fit"


def test_an_actors_stub_calls_the_transport_as_asked():
    from kdn.core.rpc import Actors
    calls = []

    class Recording(Actors):
        async def call(self, node, method, /, *args, timeout, **kw):
            calls.append(("call", node, method, args, timeout))
            return 1

        def call_sync(self, node, method, /, *args, timeout, **kw):
            calls.append(("sync", node, method, args, timeout))
            return 2

    a = Recording("net", token="tok")
    assert asyncio.run(a.edge("e1", 3.0).ping()) == 1
    assert a.origin(4.0, "sync").stored([]) == 2
    assert calls == [("call", "e1", "ping", (), 3.0), ("sync", None, "stored", ([],), 4.0)]
    with pytest.raises(TypeError, match="needs a timeout"):
        a.edge("e1")
