"""kdn.engines.vllm.plan: vLLM's rules for matched tokens, tenants by salt, deadlines, loads
and captures, with fake requests and a fake source (vLLM imported, no engine started)."""
import time
from types import SimpleNamespace

import pytest

try:
    import vllm  # noqa: F401
except (ImportError, RuntimeError) as e:   # a broken install (media packages built for another torch) raises RuntimeError
    pytest.skip(f"vLLM is not importable ({type(e).__name__}: {e}); install the vllm extra (README)",
                allow_module_level=True)

from kdn.engines.sources import Deadline, Match, Tenant, Tenants
from kdn.engines.vllm.plan import Capture, Load, Planner, Reports
from kdn.core.errors import NoLiveEdge

BLOCK = 128
KEYS = tuple(bytes([i]) * 16 for i in range(3))


class FakeSource:
    def __init__(self, match=None, delay=0.0, error=None):
        self.result, self.delay, self.error, self.calls = match, delay, error, 0

    def match(self, prompt):
        self.calls += 1
        time.sleep(self.delay)
        if self.error:
            raise self.error
        return self.result


def request(rid="r1", n=700, salt=None, params=None, skip=False):
    return SimpleNamespace(request_id=rid, prompt_token_ids=list(range(n)), cache_salt=salt,
                           kv_transfer_params=params, skip_reading_prefix_cache=skip)


def planner(sources, min_tokens=64, producer=False, salts=None, deadline_s=2.0):
    tenants = Tenants(Tenant("default"), salts or {})
    return Planner(tenants, lambda salt: sources[salt], Deadline(), BLOCK, deadline_s,
                   min_tokens=min_tokens, producer=producer)


KB644 = Match(tokens=644, keys=KEYS, kb="kb", version=1, edge="us-east-0")


def test_the_kb_tokens_past_the_local_hit_are_matched_once_per_request():
    src = FakeSource(KB644)
    p = planner({None: src})
    r = request()
    assert p.matched_tokens(r, 0) == 644
    assert p.matched_tokens(r, 256) == 388          # vLLM asks again with a local hit
    assert src.calls == 1, "vLLM may ask again: the network is asked once"
    assert p.reports["r1"] == {"held": 644, "kb": "kb", "version": 1, "edge": "us-east-0",
                               "local": 256, "external": 388}


def test_never_the_whole_prompt_and_nothing_below_min_tokens():
    p = planner({None: FakeSource(KB644)}, min_tokens=64)
    assert p.matched_tokens(request("a", n=644), 0) == 643     # the last token is computed
    assert p.matched_tokens(request("b", n=700), 640) == 0     # 4 tokens: not worth a fetch
    assert p.counters["below_min"] == 1


def test_a_salt_reads_only_its_tenant_and_an_unknown_salt_reads_nothing():
    acme, default = FakeSource(KB644), FakeSource(Match())
    p = planner({None: default, "s-acme": acme}, salts={"s-acme": Tenant("acme")})
    assert p.matched_tokens(request("a", salt="s-acme"), 0) == 644
    assert p.matched_tokens(request("b", salt="s-other"), 0) == 0
    assert p.matched_tokens(request("c"), 0) == 0
    assert (acme.calls, default.calls) == (1, 1) and p.counters["no_tenant"] == 1
    assert p.finished(request("a", salt="s-acme"))["tenant"] == "acme"
    assert p.finished(request("b", salt="s-other"))["tenant"] is None


def test_a_slow_or_dead_network_means_computing_the_prompt_within_the_deadline():
    p = planner({None: FakeSource(KB644, delay=3.0)}, deadline_s=0.3)
    t0 = time.monotonic()
    assert p.matched_tokens(request("slow"), 0) == 0
    assert time.monotonic() - t0 < 1.0 and p.counters["lookup_timeouts"] == 1
    p = planner({None: FakeSource(error=NoLiveEdge("no edge answered"))})
    assert p.matched_tokens(request("dead"), 0) == 0 and p.counters["lookup_errors"] == 1


def test_requests_whose_kv_is_not_their_tokens_alone_read_nothing():
    src = FakeSource(KB644)
    p = planner({None: src})
    lora = request("l")
    lora.lora_request = object()
    image = request("i")
    image.mm_features = [object()]
    assert p.matched_tokens(lora, 0) == 0 and p.matched_tokens(image, 0) == 0
    assert src.calls == 0
    assert p.finished(image)["skipped"] == "multimodal inputs"


def test_a_full_prefill_request_asks_nothing():
    src = FakeSource(KB644)
    p = planner({None: src})
    assert p.matched_tokens(request(skip=True), 0) == 0 and src.calls == 0


def test_a_load_names_the_chunks_and_blocks_of_its_tokens_and_goes_out_once():
    p = planner({None: FakeSource(KB644)})
    r = request()
    assert p.matched_tokens(r, 256) == 388
    p.allocated(r, [7, 8, 3, 4, 5, 6], 388)
    so = SimpleNamespace(scheduled_new_reqs=[], num_scheduled_tokens={},
                         new_block_ids_to_zero=[3, 4, 5, 6, 99])
    plan = p.plan(so)
    assert plan.loads == [Load("r1", None, "kb", 1, list(KEYS[1:3]), 256, 256, 644,
                               [7, 8, 3, 4, 5, 6], unzeroed=[3, 4, 5])]
    # tokens 256..640 fill blocks 3, 4, 5 whole: vLLM need not zero them; 6 is partly ours
    assert so.new_block_ids_to_zero == [6, 99]
    assert p.plan(so).loads == []


def test_a_capture_goes_out_in_the_step_a_chunked_prefill_completes():
    p = planner({None: FakeSource(Match())}, producer=True)
    spec = {"kdn_publish": {"kb": "kb", "documents": [["a", 300], ["b", 400]]}}
    r = request(params=spec, salt=None)
    p.new_request(r)
    step1 = SimpleNamespace(
        scheduled_new_reqs=[SimpleNamespace(req_id="r1", block_ids=([1, 2, 3, 4],), num_computed_tokens=0)],
        scheduled_cached_reqs=SimpleNamespace(req_ids=[], resumed_req_ids=set(), new_block_ids=[],
                                              num_computed_tokens=[]),
        num_scheduled_tokens={"r1": 512})
    assert p.plan(step1).captures == []
    step2 = SimpleNamespace(
        scheduled_new_reqs=[],
        scheduled_cached_reqs=SimpleNamespace(req_ids=["r1"], resumed_req_ids=set(),
                                              new_block_ids=[([5, 6],)], num_computed_tokens=[512]),
        num_scheduled_tokens={"r1": 188})
    caps = p.plan(step2).captures
    assert caps == [Capture("r1", None, "kb", [("a", 300), ("b", 400)], list(range(700)),
                            [1, 2, 3, 4, 5, 6], {})]
    assert p.plan(step2).captures == [], "a prompt is captured once"


def test_a_malformed_or_unwanted_publish_is_reported_not_raised():
    p = planner({None: FakeSource(Match())}, producer=True)
    p.new_request(request("bad", params={"kdn_publish": {"kb": "kb", "documents": [["a", 5]]}}))
    assert "documents hold 5 tokens; the prompt has 700" in p.finished(request("bad"))["error"]
    consumer = planner({None: FakeSource(Match())}, producer=False)
    consumer.new_request(request("c", n=5, params={"kdn_publish": {"kb": "kb", "documents": [["a", 5]]}}))
    assert "needs kv_role kv_both" in consumer.finished(request("c"))["error"]


def test_worker_reports_reach_the_finished_request():
    p = planner({None: FakeSource(KB644)})
    r = request()
    p.matched_tokens(r, 0)
    p.update(Reports({"r1": {"loaded": 644}}).aggregate(Reports({"r1": {"fetch_s": 0.01}})))
    got = p.finished(r)
    assert got["loaded"] == 644 and got["fetch_s"] == 0.01 and got["held"] == 644
    assert p.finished(r) == {"tenant": "default"}, "a finished request is forgotten"
