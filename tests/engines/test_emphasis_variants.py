"""kdn/engines/emphasis_variants.py on a real network with the real model: an edit lives under its own
namespace and costs only the edited chunks, a plain reader of the KB never gets an edited
chunk, an emphasized read is flagged inexact, two tenants' edits never mix, bad weights are
refused naming them with nothing stored, and `kdn serve`'s engine (kdn.serve.chat) answers with
emphasis per request (weight 1: today's tokens)."""
import numpy as np
import pytest

from kdn.engines import kv_edit as E
from kdn.serve.chat import Chat
from kdn.client import Client
from kdn.engines.emphasis_variants import emphasized_kv, plan, publish_emphasis, variant_fingerprint
from kdn.core.errors import AccessDenied, BadRequest
from kdn.serve.api import ApiError, parse_chat
from kdn.client.publish import publish_documents
from kdn.client.reader import Reader

ADMIN = "admin-secret-0123456789abcdef"
ACME, BETA = "acme-read-token-0123456789", "beta-read-token-0123456789"
BACKGROUND = " ".join(f"Room {i} of the east wing holds the archive shelves for year {1990 + i}." for i in range(24))
DOCS = [("background.md", BACKGROUND),
        ("old.md", "Policy B12, second revision (2019), superseded: the front office opens at 2 o'clock."),
        ("new.md", "Policy B12, third revision (2024), in force: the front office opens at 8 o'clock.")]
WEIGHTS = {"new.md": 3}
MESSAGES = [{"role": "user", "content": "When does the front office open? Answer with one word."}]


@pytest.fixture(scope="module")
def net(small_network, model):
    n = small_network(auth={"admin": ADMIN, "readers": {"acme": ACME, "beta": BETA}}, timeout_s=240)
    for tenant in ("acme", "beta"):
        admin = Client(network=n.name, region="us-east", tenant=tenant, fingerprint=model.fingerprint,
                       admin_token=ADMIN)
        publish_documents(admin, model, "kb", DOCS)
    return n


def client(net, model, tenant, token=None, admin=False, region="eu-west"):
    return Client(network=net.name, region=region, tenant=tenant, fingerprint=model.fingerprint,
                  token=token, admin_token=ADMIN if admin else None)


def all_manifests(net, model):
    return client(net, model, "acme", admin=True).publisher.view.origin().manifests()


@pytest.fixture(scope="module")
def published(net, model):
    admin = client(net, model, "acme", admin=True, region="us-east")
    return admin.manifest("kb"), publish_emphasis(admin, model, "kb", WEIGHTS)


def test_an_edit_lives_in_its_own_namespace_and_costs_only_the_edited_chunks(net, model, published):
    m, receipt = published
    p = plan(model, m, WEIGHTS)
    assert p.chunk >= 1 and receipt["kb_chunks"] == p.chunk          # the background is the KB's own
    fp = variant_fingerprint(model.fingerprint, p.salt)
    assert receipt["namespace_fingerprint"] == fp != model.fingerprint
    vm = Reader(client(net, model, "acme", admin=True).view, "acme", fp, token=ADMIN).manifest("kb")
    assert vm.meta["exact"] is False and vm.meta["emphasis"] == WEIGHTS and vm.meta["of"]["version"] == m.version
    edited_tokens = m.n_tokens + p.extra - p.chunk * m.chunk_tokens
    assert vm.n_tokens == edited_tokens and receipt["sent_chunks"] == len(vm.keys) == -(-edited_tokens // 256)
    assert not set(vm.keys) & set(m.keys)
    # again: nothing new travels (the variant is the KB's stored KV, edited: the same bytes)
    again = publish_emphasis(client(net, model, "acme", admin=True), model, "kb", WEIGHTS)
    assert again["sent_chunks"] == 0


def test_a_plain_reader_of_the_kb_never_gets_edited_chunks(net, model, published):
    m, _ = published
    p = plan(model, m, WEIGHTS)
    vm = Reader(client(net, model, "acme", admin=True).view, "acme", p.fingerprint(model.fingerprint),
                token=ADMIN).manifest("kb")
    reader = client(net, model, "acme", ACME)
    assert [x.name for x in reader.manifests(refresh=True)] == ["kb"]          # the variant is not listed
    ids = m.token_ids().tolist()
    exact = np.concatenate(client(net, model, "acme", admin=True).fetch(ids, kb="kb").kv_parts(), axis=3)
    for prompt in (ids, p.tail_tokens(), np.repeat(ids, p.repeats).tolist()):  # even the edited stream
        f = reader.fetch(prompt)
        assert f.exact and not set(f.keys) & set(vm.keys) and set(f.keys) <= set(m.keys)
        got = np.concatenate(f.kv_parts(), axis=3) if f.chunks else exact[:, :, :, :0]
        assert np.array_equal(got, exact[:, :, :, :got.shape[3]])


def test_an_emphasized_read_is_the_local_edit_and_never_exact(net, model, published):
    m, _ = published
    reader = client(net, model, "acme", ACME)
    exact = np.concatenate(reader.fetch(m.token_ids().tolist(), kb="kb").kv_parts(), axis=3)
    e = emphasized_kv(reader, model, m, WEIGHTS)
    assert e.source == "network" and e.exact is False and e.kb_chunks == plan(model, m, WEIGHTS).chunk
    want = E.edit(exact, plan(model, m, WEIGHTS).repeats)
    assert np.array_equal(np.concatenate(e.parts, axis=3), want) and e.extra == want.shape[3] - m.n_tokens
    local = emphasized_kv(reader, model, m, {"new.md": 2})               # no one published this edit
    assert local.source == "local" and local.exact is False
    assert np.array_equal(local.parts[0], E.edit(exact, plan(model, m, {"new.md": 2}).repeats))
    assert emphasized_kv(reader, model, m, {"new.md": 1}) is None        # weight 1: the KB as always


def test_two_tenants_edits_never_mix(net, model, published):
    m_a, _ = published
    beta_admin = client(net, model, "beta", admin=True, region="ap-south")
    m_b = beta_admin.manifest("kb")
    publish_emphasis(beta_admin, model, "kb", WEIGHTS)
    fp_a = plan(model, m_a, WEIGHTS).fingerprint(model.fingerprint)
    fp_b = plan(model, m_b, WEIGHTS).fingerprint(model.fingerprint)
    view = beta_admin.view
    va = Reader(view, "acme", fp_a, token=ADMIN).manifest("kb")
    vb = Reader(view, "beta", fp_b, token=ADMIN).manifest("kb")
    assert not set(va.keys) & set(vb.keys)
    with pytest.raises(AccessDenied):
        Reader(view, "acme", fp_a, token=BETA).manifests(refresh=True)
    e = emphasized_kv(client(net, model, "beta", BETA), model, m_b, WEIGHTS)
    assert e.source == "network" and e.exact is False


def test_bad_weights_are_refused_naming_them_and_nothing_is_stored(net, model, published):
    m, _ = published
    admin = client(net, model, "acme", admin=True)
    before = len(all_manifests(net, model))
    for weights, msg in (({"new.md": 0}, "'new.md' must be an int in \\[1, 16\\].*got 0"),
                         ({"new.md": -1}, "'new.md' must be an int.*got -1"),
                         ({"new.md": 1.5}, "'new.md' must be an int.*got 1.5"),
                         ({"nope.md": 2}, "names document 'nope.md', which the knowledge base does not have")):
        with pytest.raises(BadRequest, match=msg):
            publish_emphasis(admin, model, "kb", weights)
        with pytest.raises(BadRequest, match=msg):
            Chat(model, client(net, model, "acme", ACME)).prepare(m, MESSAGES, 4, emphasis=weights)
    assert len(all_manifests(net, model)) == before
    for bad, msg in (({"new.md": 0}, "got 0"), ({"new.md": "x"}, "got 'x'"), ([1], "must be an object")):
        with pytest.raises(ApiError, match=msg) as e:
            parse_chat({"model": "m@kb", "messages": MESSAGES, "emphasis": bad}, "m")
        assert e.value.status == 400 and e.value.param == "emphasis"
    # weights of 1 ask for the exact KV ({}); no emphasis at all leaves it to the KB's override (None)
    assert parse_chat({"model": "m@kb", "messages": MESSAGES, "emphasis": {"new.md": 1}}, "m").emphasis == {}
    assert parse_chat({"model": "m@kb", "messages": MESSAGES, "emphasis": None}, "m").emphasis is None
    assert parse_chat({"model": "m@kb", "messages": MESSAGES}, "m").emphasis is None


def test_the_service_engine_answers_with_emphasis_and_weight_one_is_todays_answer(net, model, published):
    m, _ = published
    chat = Chat(model, client(net, model, "acme", ACME))

    def answer(emphasis):
        prompt, cache, cached = chat.prepare(m, MESSAGES, 6, emphasis=emphasis)
        return [s.token for s in chat.stream(prompt, cache, cached, 6) if s.token is not None], cache, cached

    plain, cache0, cached0 = answer(None)
    same, cache1, _ = answer({"new.md": 1})
    assert same == plain and not hasattr(cache1, "kdn_extra")
    emph, cache3, cached3 = answer(WEIGHTS)
    p = plan(model, m, WEIGHTS)
    assert cached3 == cached0 == m.n_tokens and cache3.kdn_extra == p.extra
    # the reference: the same edit, generated by kdn.engines.kv_edit.forward with the bench's loop
    from kdn.bench.emphasis import Runner
    from kdn.serve.chat import messages_tokens
    exact = np.concatenate(chat.client.fetch(m.token_ids().tolist(), kb="kb").kv_parts(), axis=3)
    cache = model.cache_from_kv([E.edit(exact, p.repeats)], 16)
    q = messages_tokens(model, MESSAGES)
    logits, ref, pos = E.forward(model, q, cache, m.n_tokens, p.extra), [], m.n_tokens + len(q)
    while len(ref) < 6 and int(logits.argmax()) not in model.eos_ids:
        ref.append(int(logits.argmax()))
        logits, pos = E.forward(model, [ref[-1]], cache, pos, p.extra), pos + 1
    assert emph == ref and Runner   # noqa: the bench's loop is this one
    assert chat.counters["emphasized_network"] >= 1


def test_an_operators_override_applies_to_requests_naming_none_until_cleared(net, model, published):
    """Client.set_emphasis (the origin's override, like pin/TTL): readers list the KB with it,
    the service's engine applies it to a request that names no emphasis (the same edit, the
    same tokens as asking for it), {} still asks for the exact KV, the other tenant's KB is
    untouched, a later version keeps the weights of the documents it still has, bad weights
    change nothing, and clearing it gives today's answer again."""
    from kdn.core.emphasis import OVERRIDE_META, override_of
    admin = client(net, model, "acme", admin=True, region="us-east")
    publish_documents(admin, model, "kb2", DOCS)
    m1 = admin.manifest("kb2")
    plain_chat = Chat(model, client(net, model, "acme", ACME))

    def answer(chat, emphasis=None):
        m = chat.client.manifest("kb2")
        prompt, cache, cached = chat.prepare(m, MESSAGES, 6, emphasis=emphasis)
        tokens = [s.token for s in chat.stream(prompt, cache, cached, 6) if s.token is not None]
        return tokens, getattr(cache, "kdn_emphasis", None)

    plain, none = answer(plain_chat)
    asked, asked_w = answer(plain_chat, WEIGHTS)
    assert none is None and asked_w == WEIGHTS
    r = admin.set_emphasis("kb2", WEIGHTS)
    assert r["override"]["emphasis"] == WEIGHTS and r["pushed"] == {}      # nothing moved
    chat = Chat(model, client(net, model, "acme", ACME))                  # a fresh listing
    listed = chat.client.manifest("kb2")
    assert override_of(listed) == WEIGHTS and listed.keys == m1.keys and listed.version == m1.version
    assert answer(chat) == (asked, WEIGHTS)                               # the override: the same edit
    assert answer(chat, {}) == (plain, None)                              # {}: the exact KV
    assert chat.counters["emphasis_override"] == 1
    beta = client(net, model, "beta", BETA).manifest("kb")
    assert override_of(beta) == {}                                        # another tenant's KB
    for weights, msg in (({"nope.md": 2}, "names document 'nope.md'"), ({"new.md": 17}, "got 17")):
        with pytest.raises(BadRequest, match=msg):
            admin.set_emphasis("kb2", weights)
    with pytest.raises(AccessDenied):
        client(net, model, "acme", ACME).operator.set_emphasis("kb2", {})
    from kdn.core.errors import ManifestError
    with pytest.raises(ManifestError, match="no committed knowledge base acme/nokb"):
        admin.set_emphasis("nokb", WEIGHTS)
    with pytest.raises(BadRequest, match=f"meta key '{OVERRIDE_META}' is the origin's"):
        publish_documents(admin, model, "kb3", DOCS[:1], meta={OVERRIDE_META: WEIGHTS})
    assert override_of(client(net, model, "acme", ACME).manifest("kb2")) == WEIGHTS   # unchanged
    publish_documents(admin, model, "kb2", [d for d in DOCS if d[0] != "new.md"] + [("newer.md", "Open at 9.")])
    v2 = client(net, model, "acme", ACME).manifest("kb2")
    assert v2.version == m1.version + 1 and override_of(v2) == {}          # its documents lack new.md
    assert v2.meta[OVERRIDE_META] == WEIGHTS                              # still set, for the KB
    admin.set_emphasis("kb2", {})
    cleared = Chat(model, client(net, model, "acme", ACME))
    assert OVERRIDE_META not in cleared.client.manifest("kb2").meta
    assert answer(cleared) == answer(cleared, {})
