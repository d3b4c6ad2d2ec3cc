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


# --- conversations ----------------------------------------------------------------------
from vllm.v1.request import RequestStatus  # noqa: E402

from kdn.client.history import Found  # noqa: E402
from kdn.engines.vllm.plan import Keep  # noqa: E402

CONV = [bytes([0x40 + i]) * 16 for i in range(4)]


class FakeHistory:
    def __init__(self, found=None, worth=True, delay=0.0):
        self.found, self.worth, self.delay, self.calls = found, worth, delay, []

    def find(self, tokens, start_chunk, salt=None, hints=()):
        self.calls.append((len(tokens), start_chunk, salt, tuple(hints)))
        time.sleep(self.delay)
        return self.found

    def worth_fetching(self, found, chunk_bytes, rate):
        return self.worth


def found(held, start=0, region="us-east"):
    return Found("us-east-0", region, "us-east-0", b"s" * 16, CONV[:4 - start] if start else CONV,
                 start, held)


def conversing(sources, history, salts=None, min_tokens=64):
    tenants = Tenants(Tenant("default"), salts or {})
    return Planner(tenants, lambda salt: sources[tenants.split(salt)[0]], Deadline(), BLOCK, 0.5,
                   min_tokens=min_tokens, converses=lambda salt: tenants.of(salt) is not None,
                   histories=lambda salt: history, token_bytes=1000)


def new(p, r):
    p.new_request(r)
    return r


def test_a_plain_chats_held_history_continues_vllms_own_hit_and_loads_as_one_range():
    h = FakeHistory(found(held=3))
    p = conversing({None: FakeSource(Match())}, h)
    r = new(p, request(n=1100, params={"kdn_conversation": {"hints": ["eu-west"]}}))
    assert p.matched_tokens(r, 256) == 512             # chunks 1 and 2: 256..768
    assert h.calls == [(1100, 0, None, ("eu-west",))]
    assert p.reports["r1"]["history"] == {"region": "us-east", "edge": "us-east-0", "chunks": 3,
                                          "fetched": True}
    p.allocated(r, list(range(10, 19)), 512)
    (load,) = p.plan(SimpleNamespace(scheduled_new_reqs=[], num_scheduled_tokens={})).loads
    assert (load.kb, load.keys, load.first, load.start, load.end) == (None, [], 256, 256, 768)
    assert load.conv.keys == CONV[1:3] and load.conv.held == 2 and load.block_ids == list(range(10, 16))


def test_a_kbs_conversation_starts_after_its_whole_chunks_and_skips_its_partial_one():
    kb = Match(tokens=644, keys=KEYS, kb="kb", version=1, edge="us-east-0", covers=644)
    h = FakeHistory(found(held=2, start=2))
    p = conversing({None: FakeSource(kb)}, h)
    r = new(p, request(n=1100))
    assert p.matched_tokens(r, 0) == 1024 and h.calls[0][1] == 2
    p.allocated(r, list(range(9)), 1024)
    (load,) = p.plan(SimpleNamespace(scheduled_new_reqs=[], num_scheduled_tokens={})).loads
    assert load.keys == list(KEYS[:2]) and load.conv.keys == CONV[:2] and (load.start, load.end) == (0, 1024)


def test_nothing_is_asked_when_vllm_holds_it_or_the_kb_is_not_there_to_continue():
    h = FakeHistory(found(held=4))
    p = conversing({None: FakeSource(Match())}, h)
    assert p.matched_tokens(new(p, request("own", n=1100)), 1024) == 0       # vLLM's own cache
    half = Match(tokens=256, keys=KEYS[:1], kb="kb", version=1, covers=644)  # the KB's 2nd chunk is gone
    p = conversing({None: FakeSource(half)}, h)
    assert p.matched_tokens(new(p, request("gap", n=1100)), 0) == 256
    p = conversing({None: FakeSource(Match())}, h)
    assert p.matched_tokens(request("unseen", n=1100), 0) == 0   # never announced: not a conversation
    assert h.calls == []


def test_a_salt_narrows_the_conversation_inside_its_tenant_and_an_unknown_one_reads_nothing():
    salts = {"s-acme": Tenant("acme")}
    h = FakeHistory(found(held=3))
    p = conversing({"s-acme": FakeSource(Match())}, h, salts=salts)
    assert p.matched_tokens(new(p, request("a", n=1100, salt="s-acme|alice")), 0) == 768
    assert h.calls[-1][2] == "alice"
    assert p.finished(request("a", salt="s-acme|alice"))["tenant"] == "acme"
    assert p.matched_tokens(new(p, request("b", n=1100, salt="s-other|alice")), 0) == 0
    assert len(h.calls) == 1


def test_a_history_not_worth_fetching_or_too_slow_to_find_is_computed():
    p = conversing({None: FakeSource(Match())}, FakeHistory(found(held=3), worth=False))
    r = new(p, request(n=1100))
    assert p.matched_tokens(r, 0) == 0 and p.reports["r1"]["history"]["fetched"] is False
    p = conversing({None: FakeSource(Match())}, FakeHistory(found(held=3), delay=2.0))
    t0 = time.monotonic()
    assert p.matched_tokens(new(p, request(n=1100)), 0) == 0
    assert time.monotonic() - t0 < 1.5 and p.counters["history_timeouts"] == 1


def finished(rid="r1", n=1100, out=60, status=RequestStatus.FINISHED_STOPPED, **kw):
    r = request(rid, n=n, **kw)
    r.status, r.num_computed_tokens = status, n + out - 1
    r.all_token_ids = list(range(n + out))
    return r


def test_a_finished_answer_is_kept_from_the_kbs_whole_chunks_its_blocks_held_until_copied():
    kb = Match(tokens=644, keys=KEYS, kb="kb", version=1, covers=644)
    p = conversing({None: FakeSource(kb)}, FakeHistory())
    r = new(p, finished(params={"kdn_conversation": {"retention": "24h"}}))
    p.matched_tokens(r, 0)
    blocks = list(range(9))
    assert p.keep(r, blocks) is True
    assert p.finished(r)["keep"] == {"from_chunk": 2, "chunks": 2}
    (keep,) = p.plan(SimpleNamespace(scheduled_new_reqs=[], num_scheduled_tokens={})).keeps
    assert keep == Keep("r1", None, None, list(range(1159)), blocks, 2, "24h")


@pytest.mark.parametrize("why", ["aborted", "kept false", "full prefill", "no tenant", "short"])
def test_nothing_is_kept_of_an_aborted_unwanted_full_unreadable_or_short_answer(why):
    p = conversing({None: FakeSource(Match())}, FakeHistory(), salts={})
    kw = {"aborted": dict(status=RequestStatus.FINISHED_ABORTED),
          "kept false": dict(params={"kdn_conversation": {"keep": False}}),
          "full prefill": dict(skip=True), "no tenant": dict(salt="s-nobody"),
          "short": dict(n=200, out=40)}[why]
    r = new(p, finished(**kw))
    p.matched_tokens(r, 0)
    assert p.keep(r, list(range(10))) is False and "keep" not in p.finished(r)


def test_a_malformed_kdn_conversation_is_reported_and_nothing_is_asked_or_kept():
    h = FakeHistory(found(held=3))
    p = conversing({None: FakeSource(Match())}, h)
    r = new(p, finished(params={"kdn_conversation": {"retention": "forever"}}))
    assert p.matched_tokens(r, 0) == 0 and h.calls == []
    assert p.keep(r, list(range(10))) is False
    assert "retention must be one of" in p.finished(r)["error"]


def test_tenants_split_a_narrowed_salt():
    t = Tenants(Tenant("default"), {"s-acme": Tenant("acme"), "odd|salt": Tenant("odd")})
    assert t.split("s-acme|alice") == ("s-acme", "alice") and t.of("s-acme|alice").name == "acme"
    assert t.split("|bob") == (None, "bob") and t.of("|bob").name == "default"
    assert t.of("odd|salt").name == "odd" and t.split("odd|salt") == ("odd|salt", None)
    assert t.of("s-nobody|alice") is None and t.of("s-acme|") is None
    assert t.of("s-acme|" + "x" * 2000) is None


def test_a_failed_kb_lookup_asks_and_keeps_nothing_of_the_conversation():
    h = FakeHistory(found(held=3))
    p = conversing({None: FakeSource(error=NoLiveEdge("no edge answered"))}, h)
    r = new(p, finished())
    assert p.matched_tokens(r, 0) == 0 and h.calls == []
    assert p.keep(r, list(range(10))) is False
