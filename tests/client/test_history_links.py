"""kdn.client.history.History's links: fetch-or-recompute weighs the link as measured (its
lookups' round trips, its fetches' throughput) once there is a measurement, the topology's
declared latency and bandwidth before. No network: a stand-in view with a real Topology."""
import types

from kdn.client.history import Found, History
from kdn.placement.topology import Topology

CHUNK_BYTES = 256 * 46_080         # one SmolLM2 chunk in fp32


def history():
    topo = Topology.default_local(["us-east", "ap-south"])        # 1 GB/s, 30-80 ms between
    view = types.SimpleNamespace(region="ap-south", topology=topo)
    return History(view, "acme", "fp")


def found(held=16):
    return Found("us-east-0", "us-east", "scope", b"n" * 16, [bytes(16)] * held, 0, held)


def test_until_measured_the_declared_link_decides():
    h = history()
    assert h.links() == {}
    # 16 chunks (189 MB) over a declared 1 GB/s: ~0.3 s; recomputing 4,096 tokens at 1,000/s: 4 s
    assert h.worth_fetching(found(), CHUNK_BYTES, 1000.0)
    assert not h.worth_fetching(found(), CHUNK_BYTES, 50_000.0)      # recompute: 0.08 s
    assert h.worth_fetching(found().__class__("ap-south-0", "ap-south", "s", b"n" * 16, [], 0, 1),
                            CHUNK_BYTES, 1e9), "in the worker's own region it always is"


def test_a_measured_link_replaces_the_declared_one_as_a_moving_average():
    h = history()
    h._measured("us-east", "bytes_per_s", 20e6)                      # a slow link: 20 MB/s
    h._measured("us-east", "rtt_s", 0.001)
    assert h.links() == {"us-east": {"bytes_per_s": 20e6, "rtt_s": 0.001}}
    assert not h.worth_fetching(found(), CHUNK_BYTES, 1000.0), "9.4 s to move beats 4 s to compute? no"
    for _ in range(20):
        h._measured("us-east", "bytes_per_s", 5e9)                   # it got fast
    assert h.links()["us-east"]["bytes_per_s"] > 4.9e9
    assert h.worth_fetching(found(), CHUNK_BYTES, 1000.0)


def test_regions_past_the_hints_are_looked_in_nearest_first_as_measured():
    topo = Topology.default_local(["us-east", "eu-west", "ap-south"])     # from ap-south: eu-west 55 ms, us-east 80
    h = History(types.SimpleNamespace(region="ap-south", topology=topo), "acme", "fp")
    assert h.regions() == ["ap-south", "eu-west", "us-east"]              # declared
    assert h.regions(hints=["us-east"]) == ["ap-south", "us-east", "eu-west"]
    h._measured("eu-west", "rtt_s", 0.300)                               # measured: 150 ms one way
    assert h.regions() == ["ap-south", "us-east", "eu-west"]
    h._measured("us-east", "rtt_s", 0.400)
    assert h.regions() == ["ap-south", "eu-west", "us-east"]


def test_the_longest_tail_the_prompt_reproduces_is_taken_leaving_a_token_to_compute():
    """History._tail: of the tails the edge lists after the held chunks, the longest whose key
    the prompt's own tokens give, never one that would leave nothing to compute."""
    from kdn.core.conversation import tail_key
    h = history()
    after = bytes(range(16))
    prompt = list(range(1000, 1000 + 256 + 50))
    long_, short = tail_key(after, prompt[256:296]), tail_key(after, prompt[256:266])
    other = tail_key(after, [7] * 45)                          # other tokens: another key
    assert h._tail(prompt, after, 1, [[45, other], [40, long_], [10, short]]) == (long_, 40)
    assert h._tail(prompt[:296], after, 1, [[40, long_], [10, short]]) == (short, 10)   # all but one
    assert h._tail(prompt, after, 1, [[45, other]]) is None
    assert h.counters["tails_found"] == 2
