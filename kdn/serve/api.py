"""The OpenAI-compatible wire format of `kdn serve`: requests checked, responses and errors shaped.

Pure functions, no Ray and no model, so every rule is testable alone:
- `parse_chat(body, base_model)` checks a POST /v1/chat/completions body and says which KB
  it reads: "model": "<model>@<kb>" or "<model>@<kb>:<version>", or "model": "<model>" with
  "kb": "<kb>[:<version>]" in the body (the openai client's extra_body). Anything malformed
  is an `ApiError` 400 naming the field; another base model is 404 model_not_found. What the
  service does not do (tools, logprobs, stop, top_p, penalties, JSON response formats) is a
  400 unsupported_parameter rather than an answer that silently ignores it.
  "kdn_fetch": false (extra_body) computes the knowledge's KV in the worker instead of
  fetching it: the same service without KDN, for comparisons (`kdn bench serve`).
  "emphasis": {"doc.md": 4} (extra_body) answers over the KB's KV edited to attend more to
  those documents (kdn.engines.kv_edit; integer weights, checked against the KB's documents);
  without it a KB's emphasis override applies (an operator's setting), and {} asks for the
  exact KV. Every answer says which it got: "kdn": {"exact": bool, "emphasis": {...}}.
  A service that runs fine-tuned variants of its model (`kdn serve --variant`) takes
  "<model>+<variant>" too: the variant over its own KV. "cross_model": true (extra_body) opts
  such a request in to the base model's KV of the KB, the variant recomputing the layers of
  the pair's plan (kdn.engines.transformers.crossmodel); the answer then says "kdn":
  {"exact": false, "cross_model": {"sender", "plan", "recompute", "layers"}}. It is refused
  for the base model and for a plain chat.
  "model": "<model>" with no KB is a plain chat. Every chat's KV is kept for its next turn
  (kdn.core.conversation): prompt_cache_key names the conversation (the ingress routes its
  turns to the region that answered it), prompt_cache_retention ("in_memory" or "24h") how
  long its KV is kept idle, and cache_salt, safety_identifier and user narrow the cache's
  namespace inside the caller's tenant (never across it: the tenant is the token's).
- `tenant_of(tokens, authorization)` maps the Authorization: Bearer token to a tenant with
  the network's read tokens (kdn.core.auth.Tokens), as the edges decide reads: a tenant's read
  token reads that tenant; the admin token reads "default". Any other token, or none, reads
  "default" only where "default" is open: read tokens are off, or the operator said
  `default=*` (the openai client always sends some api_key). Otherwise no token is 401 and
  a token that is nobody's is 403, also when "default" has no read token of its own: with
  read tokens on, a tenant without one is nobody's to read (kdn.core.auth).
- `read_body(request, limit)` reads a body in bounded pieces: a Content-Length over the limit
  is refused before anything is read, a body without one (chunked) as soon as it passes it
  (413, and the connection is closed rather than drained); `parse_json` refuses a body
  nested too deeply for the parser (400 json_too_deep) instead of failing on it.
- completion, chunk and model-list objects as OpenAI clients parse them; `usage` has
  prompt_tokens, completion_tokens, total_tokens and prompt_tokens_details.cached_tokens
  (the prompt tokens whose KV came from KDN).
- `error_body` is OpenAI's {"error": {"message", "type", "code", "param"}}; `api_error` maps
  KDN's own errors to the API's (unknown KB 404, access 403, network 503, the rest 400).
"""
import json
import time
import uuid
from dataclasses import dataclass

import xxhash

from kdn.core.checks import check_int, check_number
from kdn.core.errors import AccessDenied, BadRequest, KDNError, ManifestError, NetworkError, RemoteError

DEFAULT_MAX_TOKENS = 256
MAX_TOKENS_LIMIT = 4096
DEFAULT_TENANT = "default"
RETRY_AFTER_S = 1             # what a 429 or 503 asks the client to wait

# status -> OpenAI error type
TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
         404: "not_found_error", 405: "invalid_request_error", 413: "invalid_request_error",
         429: "rate_limit_error", 500: "server_error", 502: "server_error", 503: "service_unavailable"}


class ApiError(KDNError):
    """An API request refused with an HTTP status and an OpenAI error code."""

    def __init__(self, status: int, message: str, code: str, param: str = None, retry_after: float = None,
                 close: bool = False):
        super().__init__(message)
        self.status, self.message, self.code, self.param = status, message, code, param
        self.retry_after = retry_after
        self.close = close          # answer with Connection: close (a body left unread)

    def body(self) -> dict:
        return error_body(self.status, self.message, self.code, self.param)

    def headers(self) -> dict:
        h = {"Retry-After": str(max(1, int(round(self.retry_after))))} if self.retry_after else {}
        if self.status == 401:
            h["WWW-Authenticate"] = "Bearer"
        if self.close:
            h["Connection"] = "close"
        return h


def error_body(status: int, message: str, code: str, param: str = None) -> dict:
    return {"error": {"message": message, "type": TYPES.get(status, "invalid_request_error"),
                      "code": code, "param": param}}


def bad(message: str, param: str = None, code: str = "invalid_request") -> ApiError:
    return ApiError(400, message, code, param)


MAX_CHAT_BODY_BYTES = 8 << 20  # a chat request: 256 messages of 200,000 characters fit in less


def body_too_large(size_text: str, limit: int) -> ApiError:
    return ApiError(413, f"the request body is {size_text}; the limit is {limit} bytes", "body_too_large",
                    close=True)


async def read_body(request, limit: int = MAX_CHAT_BODY_BYTES) -> bytes:
    """The body of a Starlette request, at most limit bytes: a declared Content-Length over
    it is refused before a byte is read, a chunked body as soon as it passes it (the
    pieces are kept only up to the limit); ApiError 413 (connection closed) or 400."""
    declared = request.headers.get("content-length")
    if declared is not None:
        if not declared.strip().isdigit():
            raise bad(f"Content-Length must be a number of bytes, got {declared[:40]!r}", code="invalid_body")
        if int(declared) > limit:
            raise body_too_large(f"{int(declared)} bytes (Content-Length)", limit)
    got, size = [], 0
    async for piece in request.stream():
        size += len(piece)
        if size > limit:
            raise body_too_large(f"over {limit} bytes (it was still arriving)", limit)
        got.append(piece)
    return b"".join(got)


def parse_json(raw: bytes) -> dict:
    if len(raw) > MAX_CHAT_BODY_BYTES:
        raise body_too_large(f"{len(raw)} bytes", MAX_CHAT_BODY_BYTES)
    try:
        body = json.loads(raw or b"")
    except (ValueError, UnicodeDecodeError) as e:
        raise bad(f"the request body is not valid JSON: {e}", code="invalid_json") from None
    except RecursionError:          # the parser's own bound on nesting (~1,000 levels here)
        raise bad("the request body nests JSON arrays or objects too deeply to parse (a chat "
                  "request needs 4 levels)", code="json_too_deep") from None
    if not isinstance(body, dict):
        raise bad(f"the request body must be a JSON object, got {type(body).__name__}", code="invalid_json")
    return body


MESSAGE_ROLES = ("system", "user", "assistant")
MAX_MESSAGES = 256
MAX_MESSAGE_CHARS = 200_000


def check_messages(messages) -> list:
    """[{"role", "content"}] with roles system/user/assistant and str content (or OpenAI's
    list of text parts); BadRequest naming the first bad message otherwise."""
    if not isinstance(messages, list) or not messages:
        raise BadRequest("messages must be a non-empty list of {role, content} objects")
    if len(messages) > MAX_MESSAGES:
        raise BadRequest(f"messages has {len(messages)} entries; the limit is {MAX_MESSAGES}")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise BadRequest(f"messages[{i}] must be an object, got {type(m).__name__}")
        role, content = m.get("role"), m.get("content")
        if role == "developer":          # OpenAI's newer name for the system role
            role = "system"
        if role not in MESSAGE_ROLES:
            raise BadRequest(f"messages[{i}].role must be one of {', '.join(MESSAGE_ROLES)}, got {role!r:.40}")
        if isinstance(content, list):    # [{"type": "text", "text": ...}]
            parts = []
            for j, p in enumerate(content):
                if not isinstance(p, dict) or p.get("type") != "text" or not isinstance(p.get("text"), str):
                    raise BadRequest(f"messages[{i}].content[{j}] must be a text part "
                                     "{\"type\": \"text\", \"text\": str} (this model reads text only)")
                parts.append(p["text"])
            content = "".join(parts)
        if not isinstance(content, str):
            raise BadRequest(f"messages[{i}].content must be a string, got {type(content).__name__}")
        if len(content) > MAX_MESSAGE_CHARS:
            raise BadRequest(f"messages[{i}].content is {len(content)} characters; the limit is "
                             f"{MAX_MESSAGE_CHARS}")
        out.append({"role": role, "content": content})
    return out


@dataclass
class ChatRequest:
    model: str            # as the caller named it (echoed back)
    kb: "str | None"         # None: a plain chat (no knowledge base)
    version: "int | None"
    messages: list
    max_tokens: int
    temperature: float
    stream: bool
    include_usage: bool   # stream_options.include_usage (usage is always on the last chunk here)
    seed: "int | None"
    kdn_fetch: bool = True   # False: compute the knowledge's KV here, as if there were no KDN (comparisons)
    emphasis: dict = None    # {document: int weight}: attend more to those documents (kdn.engines.kv_edit);
                             # None: the KB's override, if any; {}: the exact KV
    prompt_cache_key: str = None        # OpenAI's: which conversation (routing affinity)
    prompt_cache_retention: str = None  # OpenAI's: "in_memory" (the tenant's idle TTL) or "24h"
    salt: str = None         # cache_salt, safety_identifier, user: a narrower namespace inside the tenant
    cross_model: bool = False     # a variant opting in to the base model's KV of the KB
    history_regions: tuple = ()   # set by the ingress, never by a caller: where earlier turns were answered
    conversation: str = None      # set by the ingress, never by a caller: its name for the conversation
                                  # (kdn.serve.affinity; the region's router and replicas key by it)


def split_kb(text: str, param: str) -> tuple:
    """'kb' or 'kb:3' -> (kb, version or None)."""
    from kdn.core.manifest import check_name
    kb, sep, ver = text.partition(":")
    try:
        check_name(kb, "knowledge base name")
    except KDNError as e:
        raise bad(str(e), param) from None
    if not sep:
        return kb, None
    if not ver.isdigit() or int(ver) < 1:
        raise bad(f"a KB version must be a positive integer, got {ver!r:.40} in {text!r:.80}", param)
    return kb, int(ver)


def _int(body, name, default, lo, hi):
    v = body.get(name)
    if v is None:
        return default
    return check_int(v, name, lo, hi, error=lambda message: bad(message, name))


# what the service does not do, with the value that asks for nothing (None is always fine)
UNSUPPORTED = (("tools", None), ("tool_choice", "none"), ("logprobs", False), ("top_logprobs", None),
               ("stop", None), ("top_p", 1), ("presence_penalty", 0), ("frequency_penalty", 0))


def refuse_unsupported(body: dict) -> None:
    """ApiError 400 unsupported_parameter for a field asking what the service does not do."""
    for name, default in UNSUPPORTED:
        if body.get(name) not in (None, default) and body.get(name) != []:
            raise bad(f"{name} is not supported by this service (it answers plain text, greedy or "
                      f"sampled by temperature); leave it out", name, "unsupported_parameter")
    fmt = body.get("response_format")
    if fmt is not None and fmt != {"type": "text"}:
        raise bad("response_format must be {\"type\": \"text\"}: this service answers plain text",
                  "response_format", "unsupported_parameter")


def api_error(e: KDNError) -> ApiError:
    """The API's answer to an error KDN raised on purpose while serving a request."""
    if isinstance(e, ApiError):
        return e
    if isinstance(e, ManifestError) and str(e).startswith("no knowledge base"):
        return ApiError(404, str(e), "kb_not_found", "model")
    if isinstance(e, AccessDenied):
        return ApiError(403, str(e), "access_denied")
    if isinstance(e, NetworkError):
        return ApiError(503, f"the KDN network did not answer: {e}", "network_unavailable",
                        retry_after=RETRY_AFTER_S)
    if isinstance(e, RemoteError):     # a node's own fault: not the caller's request
        return ApiError(502, f"a KDN node failed: {e}", "network_fault")
    return ApiError(400, str(e), "invalid_request")   # BadRequest, ModelError, ManifestError, ...


def parse_chat(body: dict, base_model: str, variants=()) -> ChatRequest:
    """A checked chat request (see the module); ApiError 400/404 otherwise. variants: the
    names of the fine-tuned variants the service runs beside base_model."""
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad("model is required: a string, '<model>@<kb>' or '<model>' with \"kb\" in the body", "model")
    base, at, kb_text = model.partition("@")
    if base != base_model and base not in variants:
        also = f" and its variants {', '.join(repr(v) for v in variants)}" if variants else ""
        raise ApiError(404, f"model {model!r:.120} does not exist: this service runs {base_model!r}{also} "
                       f"(name a KB as '{base_model}@<kb>')", "model_not_found", "model")
    kb_field = body.get("kb")
    if kb_field is not None and not isinstance(kb_field, str):
        raise bad(f"kb must be a string '<kb>' or '<kb>:<version>', got {type(kb_field).__name__}", "kb")
    if at and kb_field is not None and kb_field != kb_text:
        raise bad(f"the model names KB {kb_text!r:.80} but kb says {kb_field!r:.80}: name it once", "kb")
    kb_text = kb_text if at else kb_field
    if at and not kb_text:
        raise bad(f"model {model!r:.120} names no knowledge base after '@': use '{base_model}@<kb>', "
                  f"or '{base_model}' for a plain chat", "model")
    kb, version = split_kb(kb_text, "model" if at else "kb") if kb_text else (None, None)
    try:
        messages = check_messages(body.get("messages"))
    except BadRequest as e:
        raise bad(str(e), "messages") from None
    refuse_unsupported(body)
    if body.get("n") not in (None, 1):
        raise bad(f"n must be 1 (one choice per request), got {body.get('n')!r:.20}", "n")
    mct = _int(body, "max_completion_tokens", None, 1, MAX_TOKENS_LIMIT)
    mt = _int(body, "max_tokens", None, 1, MAX_TOKENS_LIMIT)
    temperature = body.get("temperature", 0.0)
    if temperature is None:
        temperature = 0.0
    temperature = check_number(temperature, "temperature", 0, 2, error=lambda message: bad(message, "temperature"))
    stream = body.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise bad(f"stream must be true or false, got {stream!r:.40}", "stream")
    opts = body.get("stream_options") or {}
    if not isinstance(opts, dict):
        raise bad("stream_options must be an object", "stream_options")
    seed = body.get("seed")
    if seed is not None:
        check_int(seed, "seed", error=lambda message: bad(message, "seed"))
    fetch = body.get("kdn_fetch", True)
    if not isinstance(fetch, bool):
        raise bad(f"kdn_fetch must be true or false, got {fetch!r:.40}", "kdn_fetch")
    from kdn.core.emphasis import check_weights
    try:
        # absent or null: the KB's override if any; {} (or weights of 1): the exact KV; the
        # KB's document names are checked by the worker
        emphasis = None if body.get("emphasis") is None else check_weights(body["emphasis"])
    except BadRequest as e:
        raise bad(str(e), "emphasis") from None
    cross = body.get("cross_model", False)
    if cross is None:
        cross = False
    if not isinstance(cross, bool):
        raise bad(f"cross_model must be true or false, got {cross!r:.40}", "cross_model")
    if cross and base == base_model:
        raise bad(f"cross_model reads the base model's KV for one of its fine-tuned variants: "
                  f"{base_model!r} reads its own", "cross_model")
    if cross and kb is None:
        raise bad("cross_model reads another model's KV of a knowledge base: name one", "cross_model")
    if cross and (emphasis or not fetch):
        raise bad("cross_model takes the base model's KV as published: no emphasis, no kdn_fetch false",
                  "cross_model")
    return ChatRequest(model=model, kb=kb, version=version, messages=messages, cross_model=cross,
                       max_tokens=mct or mt or DEFAULT_MAX_TOKENS, temperature=float(temperature),
                       stream=stream, include_usage=bool(opts.get("include_usage")), seed=seed,
                       kdn_fetch=fetch, emphasis=emphasis, **prompt_cache(body))


def prompt_cache(body: dict) -> dict:
    """The request's prompt-cache fields, checked: prompt_cache_key and prompt_cache_retention
    as OpenAI documents them, and the salt that narrows the cache's namespace inside the
    tenant (vLLM's cache_salt, OpenAI's safety_identifier and user; all given ones count)."""
    from kdn.core.conversation import MAX_SALT_CHARS, RETENTIONS
    key = body.get("prompt_cache_key")
    if key is not None and (not isinstance(key, str) or not 0 < len(key) <= MAX_SALT_CHARS):
        raise bad(f"prompt_cache_key must be a non-empty string of at most {MAX_SALT_CHARS} "
                  f"characters, got {key!r:.60}", "prompt_cache_key")
    retention = body.get("prompt_cache_retention")
    if retention is not None and retention not in RETENTIONS:
        raise bad(f"prompt_cache_retention must be one of {', '.join(RETENTIONS)}, got {retention!r:.40}",
                  "prompt_cache_retention")
    salts = []
    for name in ("cache_salt", "safety_identifier", "user"):
        v = body.get(name)
        if v is None:
            continue
        if not isinstance(v, str) or not 0 < len(v) <= MAX_SALT_CHARS:
            raise bad(f"{name} must be a non-empty string of at most {MAX_SALT_CHARS} characters, "
                      f"got {v!r:.60}", name)
        salts.append(f"{name}={v}")
    # the salt travels as one fixed-length digest of all of them (kdn.core.conversation.check_salt)
    salt = xxhash.xxh3_128_hexdigest("\n".join(salts).encode()) if salts else None
    return {"prompt_cache_key": key, "prompt_cache_retention": retention, "salt": salt}


def credentials(tokens, authorization) -> tuple:
    """(tenant, token) a request reads with, from its Authorization header (see the module):
    token is the one the edges are shown, the caller's read token or the admin token, or
    None for an open tenant (whatever key the caller sent: an open tenant needs none)."""
    token = None
    if authorization:
        scheme, _, value = str(authorization).partition(" ")
        if scheme.lower() != "bearer" or not value.strip():
            raise ApiError(401, "Authorization must be 'Bearer <token>'", "invalid_authorization")
        token = value.strip()
    if token is not None:
        tenant = tokens.tenant_of_token(token)
        if tenant is not None:
            return tenant, token
        if tokens.is_admin(token):
            return DEFAULT_TENANT, token
    if tokens.is_open(DEFAULT_TENANT):      # read tokens off, or the operator's default=*
        return DEFAULT_TENANT, None
    if token is None:
        raise ApiError(401, "a read token is required: send Authorization: Bearer <token> (the "
                            "tenant's read token, as the edges take it)", "missing_token")
    raise ApiError(403, "the bearer token is no tenant's read token", "invalid_token")


def tenant_of(tokens, authorization) -> str:
    """The tenant a request reads as, from its Authorization header (see the module)."""
    return credentials(tokens, authorization)[0]


def completion_id() -> str:
    return "chatcmpl-" + uuid.uuid4().hex


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def kv_note(emphasis: dict = None, cross_model: dict = None) -> dict:
    """What an answer's knowledge KV was: exact, edited by these emphasis weights, or another
    model's with a recompute plan (cross_model: the plan's description)."""
    out = {"exact": not emphasis and not cross_model, "emphasis": dict(emphasis or {})}
    if cross_model:
        out["cross_model"] = dict(cross_model)
    return out


def completion(cid: str, model: str, text: str, finish: str, use: dict, created: int = None,
               kdn: dict = None) -> dict:
    out = {"id": cid, "object": "chat.completion", "created": created or int(time.time()), "model": model,
           "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                        "finish_reason": finish, "logprobs": None}],
           "usage": use}
    if kdn is not None:
        out["kdn"] = kdn
    return out


def chunk(cid: str, model: str, created: int, delta: dict, finish: str = None, use: dict = None,
          kdn: dict = None) -> dict:
    out = {"id": cid, "object": "chat.completion.chunk", "created": created, "model": model,
           "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}]}
    if use is not None:
        out["usage"] = use
    if kdn is not None:
        out["kdn"] = kdn
    return out


def sse(obj) -> bytes:
    """One server-sent event carrying obj as JSON (or the literal [DONE])."""
    data = obj if isinstance(obj, str) else json.dumps(obj, separators=(",", ":"))
    return f"data: {data}\n\n".encode()


DONE = sse("[DONE]")


async def sse_answer(model: str, pieces, prompt_tokens: int, cached, kdn: dict = None):
    """The events of one streamed answer after its status: the role chunk, a chunk per piece
    of text as it comes, the last chunk with the finish reason and usage, then [DONE].
    pieces: an async iterator of (text, tokens it adds, finish reason or None); cached: the
    prompt tokens whose KV was not computed, or a callable giving them when pieces end; kdn:
    what the knowledge's KV was (kv_note), on the last chunk."""
    cid, created = completion_id(), int(time.time())
    yield sse(chunk(cid, model, created, {"role": "assistant", "content": ""}))
    n, finish = 0, None
    async for text, count, finish in pieces:
        n += count
        if text:
            yield sse(chunk(cid, model, created, {"content": text}))
    yield sse(chunk(cid, model, created, {}, finish, usage(prompt_tokens, n, cached() if callable(cached) else cached),
                    kdn))
    yield DONE


def model_list(base_model: str, kbs, created: int = 0, variants=()) -> dict:
    """GET /v1/models: the base model, then '<model>@<kb>' per KB name (sorted), then each
    variant the service runs and its own KBs the same way. variants: their names, or {name: KB
    names published under the variant's own fingerprint}. The base model's KBs a variant may
    read with cross_model are not listed under it: that read is opt-in, never a model id."""
    own = variants if isinstance(variants, dict) else {v: () for v in variants}
    ids = [base_model] + [f"{base_model}@{kb}" for kb in sorted(set(kbs))]
    for v in sorted(own):
        ids += [v] + [f"{v}@{kb}" for kb in sorted(set(own[v]))]
    return {"object": "list",
            "data": [{"id": i, "object": "model", "created": created, "owned_by": "kdn"} for i in ids]}
