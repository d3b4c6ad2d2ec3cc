"""Running vLLM with KDN: an engine wired to a network, publishing through it, answering with it.

- `kv_transfer_config(role, **settings)`: the dict vLLM takes to load KDNConnector.
- `start_engine(settings)`: SmolLM2 (the folder kdn.engines.transformers.model converted) in vLLM with the
  connector, run in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0): scheduler, worker and
  connector then share this process's Ray connection and node, so a worker placed in a
  region reads from that region's edge, and nothing needs an `if __name__ == "__main__"`.
- `publish_with_vllm(llm, kb, documents)`: vLLM prefills the knowledge (the system turn
  kdn.engines.transformers.model renders, so prompts built by either engine start with the same tokens) and its
  connector publishes the KV vLLM computed (kv_both); the origin's receipt comes back.
- `query_with_vllm(llm, client, kb, question, check=True)`: the greedy answer with KDN and,
  with check, vLLM's own full prefill of the same prompt (its prefix cache skipped), and
  whether the tokens are identical.
- `settle(llm, limits)`: an engine this process steps (start_engine's) keeps its finished
  answers' conversations now (the connector's `conversations`): one step hands the keeps to
  the worker, which copies the KV out and sends it to the home edge, waited for (at most
  STORE_WAIT_S), and one more frees their blocks. `converse(llm, model, messages)`: one chat
  turn, kept as far as the next turn's prompt reproduces it (`keep_limit`).
- `VllmEngine(llm, model)`: the two behind the engine interface (kdn.engines.base), which
  `kdn publish/query --engine vllm` use (kdn.engines.base.load_engine starts it: VllmEngine.load).
- `EngineWorker`: an engine in a Ray actor, to place it in a region; `demo_answers` runs one
  beside the demo's transformers workers.
"""
import dataclasses
import itertools
import os
import time

from kdn.core.env import collector_paused, compute_threads
from kdn.core.errors import KDNError, ModelError
from kdn.engines.base import Answer
from kdn.client.documents import model_context
from kdn.client.publish import check_documents, knowledge_documents

MAX_MODEL_LEN = 8192
KV_CACHE_BYTES = 1 << 30      # ~22k tokens of SmolLM2 KV in fp32: several KBs at once
ENGINE_DEFAULTS = dict(dtype="float32", enforce_eager=True, max_model_len=MAX_MODEL_LEN,
                       kv_cache_memory_bytes=KV_CACHE_BYTES, disable_log_stats=False,
                       enable_prefix_caching=True)
STORE_WAIT_S = 2.0            # settle() waits this long at most for a conversation's store


def kv_transfer_config(role: str = "kv_consumer", **settings) -> dict:
    """vLLM's kv_transfer_config for KDNConnector; settings: kdn.engines.vllm.Settings."""
    if role not in ("kv_consumer", "kv_both", "kv_producer"):
        raise ModelError(f"role must be kv_consumer, kv_both or kv_producer, got {role!r}")
    return {"kv_connector": "KDNConnector", "kv_connector_module_path": "kdn.engines.vllm",
            "kv_role": role, "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {k: v for k, v in settings.items() if v is not None}}


def model_folder() -> str:
    """The SmolLM2 folder kdn.engines.transformers.model converted (converting it on first use)."""
    from kdn.engines.transformers.model import load_model
    return str(load_model(warm=False).cache_path)


@collector_paused()      # vLLM's import and engine: walked once by the collector, not at every step
def start_engine(role: str = "kv_consumer", model_path: str = None, engine: dict = None, **settings):
    """A vLLM LLM with KDNConnector in this process; engine: LLM arguments over ENGINE_DEFAULTS."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM
    args = dict(ENGINE_DEFAULTS, **(engine or {}))
    return LLM(model=model_path or model_folder(),
               kv_transfer_config=kv_transfer_config(role, **settings), **args)


def greedy(max_tokens: int, **extra):
    from vllm import SamplingParams
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, **extra)


def generate(llm, tokens, max_tokens: int, salt: str = None, full: bool = False,
             kdn_params: dict = None, exactly: bool = False) -> dict:
    """One greedy generation: {tokens, text, ttft_s, cached, kdn}. full: vLLM's own full
    prefill (its prefix cache and so KDN skipped). exactly: max_tokens tokens, no stop.
    Its conversation, if the connector keeps one, is kept before it returns (settle)."""
    prompt = {"prompt_token_ids": list(tokens)}
    if salt is not None:
        prompt["cache_salt"] = salt
    extra = {"skip_reading_prefix_cache": True} if full else {}
    if exactly:
        extra.update(min_tokens=max_tokens, ignore_eos=True)
    if kdn_params:
        extra["extra_args"] = {"kv_transfer_params": kdn_params}
    t0 = time.perf_counter()
    out = llm.generate(prompt, greedy(max_tokens, **extra), use_tqdm=False)[0]
    wall = time.perf_counter() - t0
    settle(llm)
    metrics = getattr(out, "metrics", None)
    ttft = getattr(metrics, "first_token_latency", 0.0) or wall
    return {"tokens": list(out.outputs[0].token_ids), "text": out.outputs[0].text, "ttft_s": ttft,
            "wall_s": wall, "cached": out.num_cached_tokens,
            "kdn": (out.kv_transfer_params or {}).get("kdn", {})}


def settle(llm, limits: dict = None, timeout_s: float = STORE_WAIT_S) -> dict:
    """Keep the conversations of the engine's finished requests now (see the module); limits
    {vLLM request id: tokens the next prompt reproduces}. {request id: the keeper's result}
    of its last keeps. For an engine stepped in this process (start_engine's); a
    multiprocess engine's own loop steps it, and this only waits."""
    from vllm.v1.engine.core_client import InprocClient
    from kdn.engines.vllm.connector import keep_limits, kept
    if limits:
        llm.collective_rpc(keep_limits, args=(limits,))
    inproc = isinstance(llm.llm_engine.engine_core, InprocClient)
    if inproc:
        llm.llm_engine.step()          # the finished requests' keeps reach the worker
    got = llm.collective_rpc(kept, args=(timeout_s,))[0]
    if inproc:
        llm.llm_engine.step()          # their copied blocks are freed
    return got


def keep_limit(model, messages, prompt, generated, text: str, kb_tokens=None) -> int:
    """How many leading tokens of the prompt and the tokens generated the next turn's prompt
    reproduces: the answer's text put back through the chat template (after the KB's tokens,
    if any) and compared token by token (kdn.core.conversation.reproduced), as
    kdn.serve.chat.Chat.to_keep does."""
    from kdn.core.conversation import reproduced
    history = list(messages) + [{"role": "assistant", "content": text}]
    again = model.chat_tokens(history, False) if kb_tokens is None else \
        list(kb_tokens) + model.encode(model.turns_text(history, False))
    return reproduced(list(prompt) + list(generated), again)


_turns = itertools.count()


def converse(llm, model, messages, max_tokens: int, salt: str = None, kb_tokens=None,
             full: bool = False, conversation: dict = None) -> dict:
    """One greedy chat turn: the messages as the chat template renders them (after the KB's
    tokens, if any), answered; then its conversation kept as far as the next turn's prompt
    reproduces it (keep_limit, settle). full: vLLM's own full prefill, nothing read or kept.
    conversation: kv_transfer_params["kdn_conversation"] ({"retention", "hints"}).
    {prompt, tokens, text, cached, kdn, kept (the keeper's result, None: nothing kept)}."""
    from vllm.inputs import tokens_input
    if kb_tokens is None:
        prompt = model.chat_tokens(messages)
    else:
        from kdn.serve.chat import messages_tokens
        prompt = list(kb_tokens) + messages_tokens(model, messages)
    params = {"kdn_conversation": dict(conversation or {}, **({"keep": False} if full else {}))}
    extra = {"skip_reading_prefix_cache": True} if full else {}
    sp = greedy(max_tokens, extra_args={"kv_transfer_params": params}, **extra)
    name = f"kdn-turn-{next(_turns)}"
    engine = llm.llm_engine
    rid = engine.add_request(name, tokens_input(prompt, cache_salt=salt), sp)
    out = None
    while out is None and engine.has_unfinished_requests():
        out = next((o for o in engine.step() if o.request_id == name and o.finished), None)
    if out is None:
        raise ModelError("vLLM dropped the request before it finished")
    o = out.outputs[0]
    limit = keep_limit(model, messages, prompt, o.token_ids, o.text, kb_tokens)
    kept = settle(llm, {rid: limit}).get(rid)
    return {"prompt": prompt, "tokens": list(o.token_ids), "text": o.text, "cached": out.num_cached_tokens,
            "kdn": (out.kv_transfer_params or {}).get("kdn", {}), "kept": kept, "limit": limit}


def publish_with_vllm(llm, kb: str, documents, model=None, salt: str = None, meta: dict = None) -> dict:
    """Publish documents [(name, text)] as KB `kb` with the KV vLLM computes for them.

    llm: an engine started with role kv_both and the admin token. model: a kdn.engines.transformers.model.Model,
    for the chat template and tokenizer (default load_model()). Exactly two tokens are
    generated (no stop token may end it sooner): the connector's receipt reaches the
    scheduler one step after the capture, and goes out when the request finishes.
    """
    from kdn.engines.transformers.model import load_model
    model = model or load_model(warm=False)
    named = knowledge_documents(model, check_documents(documents))
    tokens = [t for _, toks in named for t in toks]
    spec = {"kb": kb, "documents": [[n, len(t)] for n, t in named], "meta": meta or {}}
    t0 = time.perf_counter()
    got = generate(llm, tokens, 2, salt=salt, kdn_params={"kdn_publish": spec}, exactly=True)
    report = got["kdn"]
    receipt = report.get("publish")
    if receipt is None or "error" in receipt or "error" in report:
        why = (receipt or {}).get("error") or report.get("error") or "the connector sent no receipt"
        raise KDNError(f"publishing {kb!r} through vLLM failed: {why}")
    return dict(receipt, tokens=len(tokens), engine="vllm", reused_tokens=report.get("external", 0),
                prefilled_tokens=len(tokens) - report.get("external", 0) - report.get("local", 0),
                total_s=time.perf_counter() - t0, documents=[n for n, _ in named])


def query_with_vllm(llm, client, kb: str, question: str, model=None, check: bool = True,
                    max_tokens: int = 32, salt: str = None, forget_local: bool = False) -> Answer:
    """Answer `question` over KB `kb` through vLLM with KDN; with check, also with vLLM's
    own full prefill, and whether the greedy tokens are identical. With check, the KDN side
    runs once untimed first (vLLM warms its model when it starts), and vLLM's prefix cache is
    emptied before the timed answer so its knowledge still comes from KDN.

    client: a kdn Client of the engine's namespace (its fingerprint), for the KB's tokens.
    forget_local: empty vLLM's prefix cache first, so the knowledge comes from KDN even if
    this engine computed it before.
    """
    from kdn.engines.transformers.model import load_model
    model = model or load_model(warm=False)
    prompt = client.manifest(kb).token_ids().tolist() + model.question_tokens(question)
    if check:    # warm against warm: the connector's first lookup and load, untimed
        generate(llm, prompt, 1, salt=salt)
        forget_local = True      # so the timed answer still reads its knowledge from KDN
    if forget_local:
        llm.reset_prefix_cache()
    got = generate(llm, prompt, max_tokens, salt=salt)
    k = got["kdn"]
    a = Answer(question=question, text=got["text"].strip(), tokens=got["tokens"], engine="vllm",
               prompt_tokens=len(prompt), ttft_s=got["ttft_s"], kdn=k,
               cached_tokens=k.get("loaded", k.get("external", 0)),
               edge=k.get("fetched_from") or k.get("edge"), bytes_moved=k.get("bytes", 0),
               extra={"cached": got["cached"]})
    if check:
        base = generate(llm, prompt, max_tokens, salt=salt, full=True)
        a.baseline_tokens, a.baseline_ttft_s = base["tokens"], base["ttft_s"]
        a.identical = base["tokens"] == got["tokens"]
    return a


class VllmEngine:
    """vLLM with KDN's connector behind the engine interface (kdn.engines.base.Engine).

    llm: an engine from start_engine (role kv_both to publish); model: the transformers Model
    of the same folder, for the chat template and tokenizer (prompts built by either engine
    start with the same tokens)."""
    name = "vllm"

    def __init__(self, llm, model):
        from kdn.engines.fingerprint import fingerprints
        self.llm, self.model = llm, model
        self.fingerprint = fingerprints(model.cache_path)["vllm"]

    @classmethod
    def load(cls, model, role: str = "kv_consumer", **settings) -> "VllmEngine":
        """vLLM over model's folder, started in this process with KDN's connector as role;
        settings are the connector's (kdn.engines.vllm.connector.Settings)."""
        return cls(start_engine(role, str(model.cache_path), **settings), model)

    @staticmethod
    def context(model) -> tuple:
        """(the longest prompt, what names that limit): vLLM's max_model_len, or the model's
        context when shorter."""
        return min(MAX_MODEL_LEN, model_context(model) or MAX_MODEL_LEN), "vLLM's max_model_len"

    def publish(self, client, kb: str, documents, meta: dict = None, progress=None) -> dict:
        """vLLM prefills; its connector publishes (client: unused, the connector has its own)."""
        return publish_with_vllm(self.llm, kb, documents, model=self.model, meta=meta)

    def answer(self, client, kb: str, question: str, max_new_tokens: int = 48, check: bool = False):
        return query_with_vllm(self.llm, client, kb, question, model=self.model, check=check,
                               max_tokens=max_new_tokens)


def demo_answers(network: str, region: str, kb: str, documents, questions,
                 max_new_tokens: int = 24) -> list:
    """A vLLM worker in `region` (a Ray actor there) publishes `documents` as `kb` through
    vLLM, then answers `questions` from its edge, the first one checked against vLLM's own
    full prefill. Rows in kdn.cli.demo's answer format (region, edge, question, cached_tokens,
    prompt_tokens, ttft_s, baseline_ttft_s, sources, bytes_moved, identical, text)."""
    import ray
    worker = ray.remote(num_cpus=1)(EngineWorker).options(label_selector={"region": region}).remote(
        "kv_both", network=network, region=region)
    try:
        ray.get(worker.publish.remote(kb, documents), timeout=900)
        rows = []
        for i, q in enumerate(questions):
            a = ray.get(worker.query.remote({"network": network, "region": region}, kb, q,
                                            check=(i == 0), max_tokens=max_new_tokens,
                                            forget_local=True), timeout=900)
            k = a["kdn"]
            rows.append({"region": region, "engine": "vllm", "edge": k.get("fetched_from") or k.get("edge"),
                         "question": q, "cached_tokens": k.get("local", 0) + k.get("loaded", 0),
                         "prompt_tokens": a["prompt_tokens"], "ttft_s": a["ttft_s"],
                         "baseline_ttft_s": a["baseline_ttft_s"], "sources": {},
                         "bytes_moved": k.get("bytes", 0), "identical": a["identical"],
                         "text": a["text"]})
        return rows
    finally:
        ray.kill(worker)


class EngineWorker:
    """A vLLM engine with KDN in a Ray actor (ray.remote(EngineWorker).options(label_selector=
    {"region": R})): the region's reader. Methods return plain dicts."""

    def __init__(self, role: str = "kv_consumer", engine: dict = None, **settings):
        import torch
        torch.set_num_threads(compute_threads())
        from kdn.engines.transformers.model import load_model
        self.model = load_model(warm=False)      # tokenizer and chat template: vLLM computes
        self.llm = start_engine(role, str(self.model.cache_path), engine, **settings)
        self.settings = settings

    def fingerprint(self) -> str:
        from kdn.engines.fingerprint import fingerprints
        fp = self.settings.get("fingerprint", "vllm")
        return fingerprints(self.model.cache_path).get(fp, fp)

    def generate(self, tokens, max_tokens: int = 16, salt: str = None, full: bool = False,
                 forget_local: bool = False) -> dict:
        if forget_local:
            self.llm.reset_prefix_cache()
        return generate(self.llm, tokens, max_tokens, salt=salt, full=full)

    def converse(self, messages, max_tokens: int = 16, salt: str = None, full: bool = False,
                 forget_local: bool = False, conversation: dict = None) -> dict:
        """One chat turn (kdn.engines.vllm.run.converse); forget_local: vLLM's prefix cache
        emptied first, so what the engine computed before comes from KDN or is computed."""
        if forget_local:
            self.llm.reset_prefix_cache()
        return converse(self.llm, self.model, messages, max_tokens, salt=salt, full=full,
                        conversation=conversation)

    def connector_stats(self) -> dict:
        """The worker side's KDN connector stats (loads, the keeper's counters)."""
        return self.llm.collective_rpc(_stats)[0]

    def publish(self, kb: str, documents, salt: str = None) -> dict:
        return publish_with_vllm(self.llm, kb, documents, model=self.model, salt=salt)

    def client(self, client_args: dict):
        from kdn.client import Client
        return Client(fingerprint=self.fingerprint(), **client_args)

    def prompt(self, client_args: dict, kb: str, question: str) -> list:
        """The tokens of KB `kb` (read as client_args' tenant) followed by the question's turn."""
        m = self.client(client_args).manifest(kb)
        return m.token_ids().tolist() + self.model.question_tokens(question)

    def query(self, client_args: dict, kb: str, question: str, **kw) -> dict:
        a = query_with_vllm(self.llm, self.client(client_args), kb, question, model=self.model, **kw)
        return dataclasses.asdict(a)


def _stats(worker) -> dict:
    from kdn.engines.vllm.connector import _worker_connector
    c = _worker_connector()
    return {} if c is None else c.stats()
