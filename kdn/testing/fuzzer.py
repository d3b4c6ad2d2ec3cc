"""Fuzzing an edge's HTTP API: seeded hostile requests over raw sockets, every answer judged.

A `Fuzzer` knows one edge URL and one published KB (its namespace, keys and the xxh3 digest
of every chunk). It generates cases of a dozen kinds (KINDS) from a seeded RNG — truncated
and bad msgpack, msgpack headers that declare 2**31-element arrays or 4 GiB bins, wrong
types, wrong key sizes and dtypes, path tricks (../, %2e%2e, NUL, very long names), wrong
or absent Authorization tokens, wrong content types, oversized and lying bodies, slowloris
partial bodies, odd methods, bit-flipped valid bodies, and valid fetches as a control —
and sends each as bytes on its own TCP connection, so nothing in an HTTP library smooths
the input first. Raw sockets are the point: a request line with a NUL, a Content-Length
that lies, a body that never ends, can only be sent that way.

Every answer is judged (judge()): never a 5xx; a 4xx is JSON with a non-empty "message" (a
request the HTTP parser itself refuses before the application sees it is "protocol" and may
answer plain text, see PROTOCOL_KINDS); a 200 to a fetch must be frames of exactly the keys
asked for, each verified and, for a published key, equal to the published bytes; a 200 to
/v1/kbs must list no other tenant's knowledge; with a read token configured (token=), no
wrong or absent token may get a 200 from /v1/kbs, /v1/lookup or /v1/fetch. A slowloris connection is held open for a
bounded time while /health must still answer promptly. After a run, check() asks /health
and fetches the KB: the server must still serve the right bytes, and the edge's chunk count
and bytes (from /health) must be what they were before.

Besides, idle() opens connections that send half a request line, or nothing, and reports
how soon the server closes them (it must, within its idle bound).

`kdn bench fuzz --seconds N` (kdn/bench/fuzz.py) runs it for N seconds against a network of
its own and reports the edge's peak memory; tests/edge/test_fuzz_http.py runs a bounded
number of cases in its test suite.
"""
import json
import re
import socket
import time
from dataclasses import dataclass, field
from urllib.parse import quote, urlsplit

import msgpack
import numpy as np
import xxhash

from kdn.core.chunk import decode, frame_size, read_header
from kdn.core.errors import KDNError
from kdn.core.keys import MAX_FETCH_KEYS
from kdn.edge.http import MAX_BODY_BYTES

KINDS = ("valid", "truncated_msgpack", "bad_msgpack", "huge_lengths", "wrong_types",
         "wrong_sizes", "path_tricks", "auth_tokens", "content_types", "oversized",
         "slowloris", "methods", "mutations", "protocol", "repeated_keys", "bad_gzip",
         "transfer_codings")
# Malformed HTTP itself (request line, headers): aiohttp's parser answers before any handler
# runs, in plain text. Any 4xx (or a closed connection) is accepted for these.
PROTOCOL_KINDS = {"protocol"}
ENDPOINTS = ("/health", "/v1/kbs", "/v1/lookup", "/v1/fetch", "/metrics")
MAX_LINE = 8190                      # aiohttp's longest request line: longer ones are the parser's


@dataclass
class Case:
    """One request: raw bytes on a fresh connection, or (slowloris) bytes trickled for a while."""
    kind: str
    what: str                        # a short description, shown when the case fails
    raw: bytes                       # the whole request as sent (or its first part, slowloris)
    path: str = ""
    keys: list = None                # a fetch: the keys asked for (to judge a 200)
    ok_statuses: tuple = ()          # statuses this case may get besides a 4xx
    trickle: bytes = b""             # slowloris: sent one byte per step after raw
    head: bool = False               # a HEAD request: no body in the answer
    parser: bool = False             # malformed HTTP syntax: the parser refuses it (see PROTOCOL_KINDS)


@dataclass
class Reply:
    status: int
    headers: dict                    # lower-case names
    body: bytes


@dataclass
class Report:
    cases: dict = field(default_factory=dict)        # kind -> count
    statuses: dict = field(default_factory=dict)     # status (or "closed") -> count
    problems: list = field(default_factory=list)     # (kind, what, problem)
    health_ms_max: float = 0.0                       # slowest /health during slowloris
    parser_refusals: int = 0                         # 4xx from the HTTP parser, not the API
    seconds: float = 0.0

    def add(self, kind, status):
        self.cases[kind] = self.cases.get(kind, 0) + 1
        self.statuses[str(status)] = self.statuses.get(str(status), 0) + 1

    def to_dict(self) -> dict:
        return {"cases": dict(self.cases), "total": sum(self.cases.values()),
                "statuses": dict(sorted(self.statuses.items())), "problems": list(self.problems),
                "health_ms_max": self.health_ms_max, "parser_refusals": self.parser_refusals,
                "seconds": self.seconds}


def _request(method: str, path: str, host: str, body: bytes = None, headers: dict = None,
             content_length=True) -> bytes:
    """An HTTP/1.1 request as bytes; Connection: close so the server ends the answer by closing."""
    lines = [f"{method} {path} HTTP/1.1".encode("latin-1", "replace") if isinstance(path, str)
             else method.encode() + b" " + path + b" HTTP/1.1",
             f"Host: {host}".encode(), b"Connection: close"]
    for k, v in (headers or {}).items():
        lines.append(k.encode("latin-1") + b": " + (v if isinstance(v, bytes) else v.encode("latin-1")))
    if body is not None and content_length is True:
        lines.append(f"Content-Length: {len(body)}".encode())
    elif content_length not in (True, None, False):
        lines.append(b"Content-Length: " + str(content_length).encode())
    return b"\r\n".join(lines) + b"\r\n\r\n" + (body or b"")


def _malformed_header(headers: dict) -> bool:
    """A header value with a control byte (NUL, DEL) or a byte over 0x7e: llhttp refuses the request."""
    return any(b < 0x20 and b != 0x09 or b >= 0x7f
               for v in headers.values() for b in (v if isinstance(v, bytes) else v.encode("latin-1")))


def parse_reply(data: bytes, head: bool = False):
    """Reply from the bytes a server sent before closing; None when it sent nothing."""
    if not data:
        return None
    end = data.find(b"\r\n\r\n")
    if end < 0:
        raise ValueError(f"answer without a complete header: {data[:120]!r}")
    lines = data[:end].split(b"\r\n")
    parts = lines[0].split(b" ", 2)
    status = int(parts[1])
    headers = {}
    for line in lines[1:]:
        k, _, v = line.partition(b":")
        headers[k.strip().lower().decode("latin-1")] = v.strip().decode("latin-1")
    body = data[end + 4:]
    if head:
        return Reply(status, headers, b"")
    if headers.get("transfer-encoding", "").lower() == "chunked":
        out, rest = bytearray(), body
        while rest:
            size_line, _, rest = rest.partition(b"\r\n")
            n = int(size_line.split(b";")[0], 16)
            if n == 0:
                break
            out += rest[:n]
            rest = rest[n + 2:]
        body = bytes(out)
    elif "content-length" in headers:
        body = body[:int(headers["content-length"])]
    return Reply(status, headers, body)


class Fuzzer:
    """Hostile requests against one edge URL; judge every answer; count by kind and status."""

    def __init__(self, url: str, ns: bytes, keys: list, digests: dict, tenant: str,
                 fingerprint: str, seed: int = 0, timeout_s: float = 10.0,
                 slow_s: float = 1.0, regions: tuple = (), token: str = None):
        u = urlsplit(url)
        self.host, self.port = u.hostname, u.port
        self.hostport = f"{self.host}:{self.port}"
        self.ns, self.keys = bytes(ns), [bytes(k) for k in keys]
        self.digests = dict(digests)             # key -> xxh3_64 of the published KV bytes
        self.tenant, self.fingerprint = tenant, fingerprint
        self.rng = np.random.default_rng(seed)
        self.timeout_s, self.slow_s = timeout_s, slow_s
        self.regions = tuple(regions)
        # The tenant's read token, when the network requires one: sent with every case except
        # auth_tokens (whose wrong tokens must then be refused, never answered 200).
        self.token = token
        self.report = Report()

    # --- transport --------------------------------------------------------------------------
    def _connect(self):
        return socket.create_connection((self.host, self.port), timeout=self.timeout_s)

    def _read_all(self, s, head: bool = False) -> bytes:
        """Bytes of one answer: up to its Content-Length when it has one, else up to the close.

        A server may keep the connection open after answering (aiohttp lingers to drain a
        body it refused), so waiting for the close alone would miss answers.
        """
        data = bytearray()
        try:
            while True:
                end = data.find(b"\r\n\r\n")
                if end >= 0:
                    if head:
                        break
                    m = re.search(rb"(?im)^content-length:\s*(\d+)\s*$", bytes(data[:end]))
                    if m and len(data) >= end + 4 + int(m.group(1)):
                        break
                b = s.recv(1 << 16)
                if not b:
                    break
                data += b
        except ConnectionResetError:
            pass
        return bytes(data)

    def send(self, case: Case):
        """The server's Reply to a case (None: it closed without answering)."""
        with self._connect() as s:
            try:
                s.sendall(case.raw)
                if case.trickle:
                    return self._trickle(s, case)
            except (BrokenPipeError, ConnectionResetError):
                pass        # the server answered (and closed) before taking the whole body
            return parse_reply(self._read_all(s, case.head), case.head)

    def _trickle(self, s, case: Case):
        """Slowloris: one byte per step for slow_s seconds while /health must stay prompt."""
        step = self.slow_s / max(1, len(case.trickle))
        worst = 0.0
        for i in range(len(case.trickle)):
            s.sendall(case.trickle[i:i + 1])
            t0 = time.perf_counter()
            h = self.health()
            worst = max(worst, time.perf_counter() - t0)
            if not h.get("ok"):
                raise KDNError(f"/health failed during a slowloris connection: {h}")
            time.sleep(max(0.0, step - (time.perf_counter() - t0)))
        self.report.health_ms_max = max(self.report.health_ms_max, worst * 1e3)
        return None         # the client gives up: the server must not need it to

    def _get(self, path: str) -> Reply:
        with self._connect() as s:
            s.sendall(_request("GET", path, self.hostport))
            return parse_reply(self._read_all(s))

    def health(self) -> dict:
        r = self._get("/health")
        if r is None or r.status != 200:
            return {"ok": False, "status": None if r is None else r.status}
        return json.loads(r.body)

    # --- cases ------------------------------------------------------------------------------
    def _pick(self, seq):
        return seq[int(self.rng.integers(len(seq)))]

    def _rand_bytes(self, lo, hi) -> bytes:
        return self.rng.bytes(int(self.rng.integers(lo, hi + 1)))

    def _valid_body(self, n_keys=None, region=True) -> tuple:
        n = len(self.keys) if n_keys is None else n_keys
        keys = self.keys[:n]
        body = {"ns": self.ns, "keys": keys}
        if region and self.regions and self.rng.random() < 0.5:
            body["region"] = self._pick(self.regions)
        return msgpack.packb(body, use_bin_type=True), keys

    def _post(self, kind, what, path, body, headers=None, keys=None, ok=(), content_length=True):
        hdrs = {"Content-Type": "application/msgpack"}
        hdrs.update(self._auth())
        hdrs.update(headers or {})
        hdrs = {k: v for k, v in hdrs.items() if v is not None}
        return Case(kind, what, _request("POST", path, self.hostport, body, hdrs, content_length),
                    path=path, keys=keys, ok_statuses=ok, parser=_malformed_header(hdrs))

    def case(self, kind: str) -> Case:
        return getattr(self, "_case_" + kind)()

    def _case_valid(self):
        path = self._pick(("/v1/fetch", "/v1/lookup"))
        body, keys = self._valid_body(int(self.rng.integers(1, len(self.keys) + 1)))
        return self._post("valid", f"valid {path} of {len(keys)} keys", path, body, keys=keys, ok=(200,))

    def _case_truncated_msgpack(self):
        body, _ = self._valid_body()
        cut = int(self.rng.integers(1, len(body)))
        path = self._pick(("/v1/fetch", "/v1/lookup"))
        return self._post("truncated_msgpack", f"{path} body cut at {cut}/{len(body)}", path, body[:cut])

    def _case_bad_msgpack(self):
        valid, _ = self._valid_body()
        choices = [
            ("random bytes", self._rand_bytes(1, 256)),
            ("reserved byte 0xc1", b"\xc1" + self._rand_bytes(0, 16)),
            ("valid map then trailing garbage", valid + self._rand_bytes(1, 32)),
            ("two maps", valid + valid),
            ("json body", json.dumps({"ns": self.ns.hex(), "keys": [k.hex() for k in self.keys]}).encode()),
            ("fixext timestamp", msgpack.packb({"ns": self.ns, "keys": [msgpack.Timestamp(1, 2)]},
                                              datetime=False)),
            ("ext type", msgpack.packb({"ns": self.ns, "keys": [msgpack.ExtType(5, b"x" * 16)]})),
            ("deep nesting", b"\x91" * 5000 + b"\xc0"),
            ("NUL bytes", b"\x00" * int(self.rng.integers(1, 64))),
        ]
        what, body = self._pick(choices)
        return self._post("bad_msgpack", what, self._pick(("/v1/fetch", "/v1/lookup")), body)

    def _case_huge_lengths(self):
        n = self._pick((2**31, 2**32 - 1, 2**31 - 1, MAX_FETCH_KEYS + 2))
        b32 = n.to_bytes(4, "big")
        ns_field = b"\xa2ns" + b"\xc4\x10" + self.ns
        choices = [
            ("array32 of 2**31-ish elements", b"\xdd" + b32),
            ("map32 of 2**31-ish pairs", b"\xdf" + b32),
            ("bin32 declaring 4 GiB", b"\xc6" + b32 + b"x" * 16),
            ("str32 declaring 4 GiB", b"\xdb" + b32 + b"x" * 16),
            ("ext32 declaring 4 GiB", b"\xc9" + b32 + b"\x01" + b"x" * 8),
            ("keys: array32 huge", b"\x82" + ns_field + b"\xa4keys" + b"\xdd" + b32),
            ("ns: bin32 huge", b"\x82\xa2ns\xc6" + b32 + b"\xa4keys\x90"),
            ("key: bin32 huge", b"\x82" + ns_field + b"\xa4keys\x91\xc6" + b32 + b"y" * 8),
            ("map key str32 huge", b"\x81\xdb" + b32 + b"ns"),
        ]
        what, body = self._pick(choices)
        if self.rng.random() < 0.25:
            declared = self._pick((MAX_BODY_BYTES + 1, 2**31, 2**40, 2**63 - 1))
            return self._post("huge_lengths", f"Content-Length {declared}, {len(body)} bytes sent",
                              "/v1/fetch", body, content_length=declared)
        return self._post("huge_lengths", what, self._pick(("/v1/fetch", "/v1/lookup")), body)

    def _case_wrong_types(self):
        odd = [None, True, 1, -1, 2**63, 1.5, "x" * 16, [], {}, [self.ns], {"a": 1}, b""]
        field_ = self._pick(("ns", "keys", "region", "body", "key item", "map key"))
        body = {"ns": self.ns, "keys": list(self.keys)}
        v = self._pick(odd)
        if field_ == "body":
            raw = msgpack.packb(v, use_bin_type=True)
        elif field_ == "key item":
            body["keys"][int(self.rng.integers(len(body["keys"])))] = v
            raw = msgpack.packb(body, use_bin_type=True)
        elif field_ == "map key":
            raw = msgpack.packb({self._pick((1, 2.5, b"ns", None, True)): self.ns, "keys": body["keys"]},
                                use_bin_type=True)
        else:
            body[field_] = v
            raw = msgpack.packb(body, use_bin_type=True)
        path = self._pick(("/v1/fetch", "/v1/lookup"))
        ok = (200,) if field_ == "region" and v is None else ()
        return self._post("wrong_types", f"{path} {field_} = {v!r:.40}", path, raw,
                          keys=self.keys if ok else None, ok=ok)

    def _case_wrong_sizes(self):
        size = self._pick((0, 1, 15, 17, 32, 255, 1024))
        what = self._pick(("ns", "key", "too many keys", "dtype field", "codec field", "shape field"))
        body = {"ns": self.ns, "keys": list(self.keys)}
        if what == "ns":
            body["ns"] = self._rand_bytes(size, size)
        elif what == "key":
            body["keys"][int(self.rng.integers(len(body["keys"])))] = self._rand_bytes(size, size)
        elif what == "too many keys":
            body["keys"] = [self.keys[0]] * (MAX_FETCH_KEYS + 1 + size)
        else:
            body[what.split()[0]] = self._pick(("float128", "bfloat8", "int4", "../../etc", "",
                                                [2**31, 2**31], -1, "float16"))
        path = self._pick(("/v1/fetch", "/v1/lookup"))
        return self._post("wrong_sizes", f"{path} {what} ({size} bytes)", path,
                          msgpack.packb(body, use_bin_type=True))

    def _names(self):
        long = "a" * int(self._pick((1025, 4000, 7000)))
        return [self.tenant, "../../etc/passwd", "..", "%2e%2e%2f%2e%2e", "a%00b", "%00", "\\..\\",
                "./.", "/", long, "ten ant", "%ff%fe", "%zz", "é" * 600, "*", "'; DROP TABLE kbs;--"]

    def _case_path_tricks(self):
        r = self.rng.random()
        if r < 0.5:
            tenant, fp = self._pick(self._names()), self._pick([self.fingerprint] + self._names())
            enc = self.rng.random() < 0.5
            qt = quote(tenant, safe="%") if enc else quote(tenant, safe="%/.\\*'; ")
            qf = quote(fp, safe="%") if enc else quote(fp, safe="%/.\\*'; ")
            qt, qf = qt.replace(" ", "%20"), qf.replace(" ", "%20")
            path = f"/v1/kbs?tenant={qt}&fingerprint={qf}"
            if self.rng.random() < 0.2:
                path += f"&tenant={quote(self.tenant)}"
            return Case("path_tricks", f"kbs tenant={tenant!r:.40} fp={fp!r:.40}",
                        _request("GET", path, self.hostport, headers=self._auth()), path=path,
                        ok_statuses=(200,), parser=len(path) > MAX_LINE)
        paths = ["/v1/../health", "/v1/%2e%2e/health", "/%2e%2e/%2e%2e/etc/passwd", "/../../etc/passwd",
                 "/v1/kbs/../fetch", "//v1//fetch", "/v1/fetch%00", "/v1/fetch/", "/v1/fetch/..",
                 "/v1/./fetch", "/V1/FETCH", "/v1/fetch;x=1", "/v1/fetch%2f..", "/health/..%2f..%2f",
                 "/" + "a" * int(self._pick((2000, 7000))), "/v1/fetch?" + "x" * 3000, "/%c0%ae%c0%ae/",
                 "/v1/fetch#frag", "/v1/kbs?tenant=%&fingerprint=%"]
        path = self._pick(paths)
        if path.startswith(("/v1/fetch", "//v1//fetch", "/v1/./fetch", "/v1/kbs/../fetch")):
            body, keys = self._valid_body()
            return self._post("path_tricks", f"POST {path:.60}", path, body, keys=keys, ok=(200,))
        return Case("path_tricks", f"GET {path:.60}", _request("GET", path, self.hostport,
                                                               headers=self._auth()),
                    path=path, ok_statuses=(200,))

    def _case_auth_tokens(self):
        right = (self.token or "right-token-never-configured").encode()
        token = self._pick((None, b"Bearer wrong", b"Bearer ", b"", b"Basic Zm9vOmJhcg==",
                            b"Bearer " + b"A" * 4000, b"Bearer \xff\xfe\x00bad",
                            b"bearer " + self.rng.bytes(16).hex().encode(), b"Token " + b"x" * 64,
                            b"Bearer a, Bearer b", b"Bearer " + right[:-1], b"Bearer " + right + b"x",
                            b"Basic " + right, right, b"Bearer " + right.upper()))
        path = self._pick(("/health", "/v1/kbs", "/v1/fetch", "/v1/lookup", "/metrics"))
        hdrs = {} if token is None else {"Authorization": token}
        if self.rng.random() < 0.3:
            hdrs["X-KDN-Token"] = self._pick((b"wrong", b"", b"\x00", right))
        # With a read token configured, no wrong token may read the tenant's knowledge.
        guarded = self.token is not None and path not in ("/health", "/metrics")
        ok = (401, 403) if guarded else (200, 401, 403)
        what = f"{path} Authorization {(token or b'(none)')[:30]!r}"
        if path in ("/v1/fetch", "/v1/lookup"):
            body, keys = self._valid_body()
            case = self._post("auth_tokens", what, path, body, keys=keys, ok=ok)
            case.raw = _request("POST", path, self.hostport, body,
                                dict(hdrs, **{"Content-Type": "application/msgpack"}))
        else:
            if path == "/v1/kbs":
                path = f"/v1/kbs?tenant={quote(self.tenant)}&fingerprint={quote(self.fingerprint)}"
            case = Case("auth_tokens", "GET " + what, _request("GET", path, self.hostport, headers=hdrs),
                        path=path, ok_statuses=ok)
        case.parser = _malformed_header(hdrs)
        return case

    def _auth(self) -> dict:
        return {"Authorization": f"Bearer {self.token}"} if self.token else {}

    def _case_content_types(self):
        ctype = self._pick(("application/json", "text/plain", "multipart/form-data; boundary=x",
                            "application/x-www-form-urlencoded", None, "\x00", "a" * 3000,
                            "application/msgpack; charset=../../x", "application/x-kdn-frames"))
        valid = self.rng.random() < 0.5
        if valid:
            body, keys = self._valid_body()
        else:
            keys = None
            body = self._pick((b"ns=x&keys=y", b'{"ns": "00", "keys": []}',
                               b"--x\r\nContent-Disposition: form-data; name=\"ns\"\r\n\r\nx\r\n--x--\r\n"))
        path = self._pick(("/v1/fetch", "/v1/lookup"))
        return self._post("content_types", f"{path} Content-Type {ctype!r:.40} valid={valid}", path, body,
                          {"Content-Type": ctype}, keys=keys, ok=(200, 415) if valid else (415,))

    def _case_oversized(self):
        how = self._pick(("declared", "chunked", "exact limit garbage", "many headers", "huge header"))
        path = self._pick(("/v1/fetch", "/v1/lookup"))
        if how == "declared":
            body = self._rand_bytes(MAX_BODY_BYTES + 1, MAX_BODY_BYTES + 4096)
            return self._post("oversized", f"{path} {len(body)}-byte body", path, body)
        if how == "chunked":
            n = MAX_BODY_BYTES + int(self.rng.integers(1, 1 << 16))
            piece = 1 << 16
            raw = b"".join(f"{min(piece, n - i):x}\r\n".encode() + b"\x00" * min(piece, n - i) + b"\r\n"
                           for i in range(0, n, piece)) + b"0\r\n\r\n"
            return self._post("oversized", f"{path} chunked {n} bytes", path, raw,
                              {"Transfer-Encoding": "chunked"}, content_length=None)
        if how == "exact limit garbage":
            return self._post("oversized", f"{path} {MAX_BODY_BYTES} bytes of 0xc1", path,
                              b"\xc1" * MAX_BODY_BYTES)
        if how == "many headers":
            hdrs = {f"X-Junk-{i}": "v" * 100 for i in range(int(self._pick((120, 500))))}
            body, keys = self._valid_body()
            return self._post("protocol", f"{path} with {len(hdrs)} headers", path, body, hdrs,
                              keys=keys, ok=(200,))
        body, keys = self._valid_body()
        return self._post("protocol", f"{path} with a 20000-byte header", path, body,
                          {"X-Junk": "v" * 20000}, keys=keys, ok=(200,))

    def _case_slowloris(self):
        body, _ = self._valid_body()
        if self.rng.random() < 0.5:
            raw = _request("POST", "/v1/fetch", self.hostport, body,
                           {"Content-Type": "application/msgpack"})
            cut = len(raw) - len(body) + int(self.rng.integers(0, len(body)))
            return Case("slowloris", f"fetch body trickled from byte {cut}", raw[:cut],
                        trickle=raw[cut:cut + 8])
        raw = _request("GET", "/health", self.hostport)
        return Case("slowloris", "request header trickled", raw[:10], trickle=raw[10:18])

    def _case_methods(self):
        method = self._pick(("PUT", "DELETE", "PATCH", "OPTIONS", "TRACE", "CONNECT", "FOO", "get",
                             "HEAD", "POST", "GET"))
        path = self._pick(ENDPOINTS)
        if method == "POST" and path in ("/v1/fetch", "/v1/lookup"):
            method = "PUT"
        if method == "GET" and path in ("/health", "/metrics"):
            method = "POST"
        head = method == "HEAD"
        ok = (200,) if head and path in ("/health", "/metrics") else ()
        raw = _request(method, path, self.hostport, b"x" if method in ("PUT", "PATCH", "POST") else None)
        # llhttp knows the registered methods only, in upper case: others are a parse error
        return Case("methods", f"{method} {path}", raw, path=path, ok_statuses=ok, head=head,
                    parser=method in ("FOO", "get"))

    def _case_mutations(self):
        body, keys = self._valid_body(region=False)
        b = bytearray(body)
        for _ in range(int(self.rng.integers(1, 4))):
            i = int(self.rng.integers(len(b)))
            b[i] = int(self.rng.integers(256))
        path = self._pick(("/v1/fetch", "/v1/lookup"))
        return self._post("mutations", f"{path} valid body with bytes changed", path, bytes(b),
                          keys=None, ok=(200,))

    def _case_repeated_keys(self):
        """One key asked for many times: a small body that once made an edge encode and hold
        a copy per repeat. A chain of prefix keys never repeats: refused (400)."""
        n = int(self._pick((2, 128, 4096, MAX_FETCH_KEYS)))
        keys = self._pick(([self.keys[0]] * n, list(self.keys) + [self.keys[-1]] * (n - 1)))
        body = {"ns": self.ns, "keys": keys}
        codec = self._pick((None, "raw", "zstd", "auto"))
        if codec is not None:
            body["codec"] = codec
        return self._post("repeated_keys", f"/v1/fetch {len(keys)} keys with repeats, codec {codec}",
                          "/v1/fetch", msgpack.packb(body, use_bin_type=True))

    def _case_bad_gzip(self):
        import gzip
        import zlib
        body, keys = self._valid_body(region=False)
        good = gzip.compress(body)
        choices = [
            ("gzip", "garbage", self._rand_bytes(1, 512), ()),
            ("gzip", "truncated", good[:max(1, len(good) // 2)], ()),
            ("gzip", "bad crc", good[:-8] + bytes(8), ()),
            ("gzip", "bomb: 64 MiB of zeros", self._bomb(), ()),
            ("deflate", "garbage", self._rand_bytes(1, 512), ()),
            ("deflate", "truncated", zlib.compress(body)[:8], ()),
            ("gzip", "valid", good, (200,)),
        ]
        enc, what, raw, ok = choices[int(self.rng.integers(len(choices)))]
        path = self._pick(("/v1/fetch", "/v1/lookup"))
        case = self._post("bad_gzip", f"{path} Content-Encoding {enc}: {what}", path, raw,
                          {"Content-Encoding": enc}, keys=keys if ok else None, ok=ok)
        case.parser = True          # aiohttp's parser may find the bad encoding first (plain text)
        return case

    def _bomb(self) -> bytes:
        """64 MiB of zeros, gzipped (~64 KiB); made once."""
        if getattr(self, "_bomb_bytes", None) is None:
            import gzip
            self._bomb_bytes = gzip.compress(bytes(64 << 20), 9)
        return self._bomb_bytes

    def _case_transfer_codings(self):
        body, _ = self._valid_body(region=False)
        chunked = f"{len(body):x}\r\n".encode() + body + b"\r\n0\r\n\r\n"
        te, raw = self._pick((("gzip, chunked", chunked), ("gzip", body), ("chunked, chunked", chunked),
                              ("identity", body), ("x-custom, chunked", chunked), ("deflate", body)))
        path = self._pick(("/v1/fetch", "/v1/lookup"))
        case = self._post("transfer_codings", f"{path} Transfer-Encoding {te}", path, raw,
                          {"Transfer-Encoding": te}, content_length=None)
        case.parser = True          # llhttp may refuse some itself, in plain text
        return case

    # --- idle connections -------------------------------------------------------------------
    def idle(self, n: int = 4, wait_s: float = 30.0) -> dict:
        """Open n connections that send half a request line or nothing; {"closed": how many
        the server closed within wait_s, "open": how many it did not, "seconds": the slowest}."""
        socks = []
        for i in range(n):
            s = self._connect()
            if i % 2:
                s.sendall(b"GET /hea")
            socks.append(s)
        t0, closed, slowest = time.monotonic(), 0, 0.0
        for s in socks:
            s.settimeout(max(0.1, wait_s - (time.monotonic() - t0)))
            try:
                while s.recv(4096):
                    pass
                closed += 1
                slowest = time.monotonic() - t0
            except ConnectionResetError:
                closed += 1
                slowest = time.monotonic() - t0
            except socket.timeout:
                pass
            finally:
                s.close()
        return {"closed": closed, "open": n - closed, "seconds": round(slowest, 2)}

    def _case_protocol(self):
        choices = [
            ("NUL in request line", b"GET /hea\x00lth HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"),
            ("no HTTP version", b"GET /health\r\n\r\n"),
            ("HTTP/9.9", b"GET /health HTTP/9.9\r\nHost: x\r\nConnection: close\r\n\r\n"),
            ("garbage line", self.rng.bytes(64) + b"\r\n\r\n"),
            ("header without colon", b"GET /health HTTP/1.1\r\nHost x\r\nConnection: close\r\n\r\n"),
            ("bad Content-Length", b"POST /v1/fetch HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n"
                                   b"Connection: close\r\n\r\n"),
            ("negative Content-Length", b"POST /v1/fetch HTTP/1.1\r\nHost: x\r\nContent-Length: -1\r\n"
                                        b"Connection: close\r\n\r\n"),
            ("two Content-Lengths", b"POST /v1/fetch HTTP/1.1\r\nHost: x\r\nContent-Length: 1\r\n"
                                    b"Content-Length: 2\r\nConnection: close\r\n\r\nxx"),
            ("bad chunk size", b"POST /v1/fetch HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n"
                               b"Connection: close\r\n\r\nzz\r\nxx\r\n0\r\n\r\n"),
            ("CL and TE both", b"POST /v1/fetch HTTP/1.1\r\nHost: x\r\nContent-Length: 4\r\n"
                               b"Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n0\r\n\r\n"),
            ("request line too long", b"GET /" + b"a" * 20000 + b" HTTP/1.1\r\nHost: x\r\n\r\n"),
            ("raw non-ASCII path", b"GET /\xff\xfe/health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"),
        ]
        what, raw = self._pick(choices)
        # An HTTP/0.9-style line (no version) is a plain GET to llhttp: /health answers it.
        return Case("protocol", what, raw, ok_statuses=(200,) if what in ("HTTP/9.9", "no HTTP version") else ())

    # --- judging ----------------------------------------------------------------------------
    def judge(self, case: Case, reply) -> str:
        """'' when the answer is acceptable, else what is wrong with it."""
        if reply is None:
            if case.trickle or case.kind in PROTOCOL_KINDS or case.parser:
                return ""
            return "the server closed the connection without an answer"
        st = reply.status
        if st >= 500:
            return f"{st}: {reply.body[:300]!r}"
        if st == 200:
            if 200 not in case.ok_statuses:
                return f"200 to a request that must be refused: {reply.body[:200]!r}"
            return self._judge_ok(case, reply)
        if not 400 <= st < 500:
            return f"status {st} is neither 200 nor a 4xx"
        if case.kind in PROTOCOL_KINDS or case.parser or case.head:
            if not reply.headers.get("content-type", "").startswith("application/json"):
                self.report.parser_refusals += 1
            return ""               # the HTTP parser's own refusal, or an answer with no body
        ctype = reply.headers.get("content-type", "")
        if not ctype.startswith("application/json"):
            return f"{st} without a JSON body ({ctype!r}): {reply.body[:200]!r}"
        try:
            doc = json.loads(reply.body)
        except ValueError:
            return f"{st} with invalid JSON: {reply.body[:200]!r}"
        if not isinstance(doc, dict) or not isinstance(doc.get("message"), str) or not doc["message"]:
            return f"{st} without a message: {doc!r:.200}"
        return ""

    def _judge_ok(self, case: Case, reply: Reply) -> str:
        ctype = reply.headers.get("content-type", "")
        if case.head:
            return ""
        if ctype.startswith("application/x-kdn-frames"):
            return self._judge_frames(case, reply.body)
        if ctype.startswith("application/json"):
            try:
                doc = json.loads(reply.body)
            except ValueError:
                return f"200 with invalid JSON: {reply.body[:200]!r}"
            if "manifests" in doc:
                if doc.get("tenant") != self.tenant and doc["manifests"]:
                    return f"/v1/kbs for tenant {doc.get('tenant')!r:.60} listed {len(doc['manifests'])} KBs"
                for m in doc["manifests"]:
                    if m.get("tenant", self.tenant) != self.tenant:
                        return f"/v1/kbs listed a KB of tenant {m.get('tenant')!r}"
            return ""
        if ctype.startswith("text/plain") and case.path.startswith("/metrics"):
            return ""
        return f"200 with unexpected Content-Type {ctype!r}"

    def _judge_frames(self, case: Case, body: bytes) -> str:
        """A fetch answer: frames of a prefix of the keys asked, each verified, published ones exact."""
        mv, off, i = memoryview(body), 0, 0
        keys = case.keys
        try:
            while off < len(mv):
                header, poff = read_header(mv[off:])
                end = off + frame_size(header, poff)
                c = decode(mv[off:end])
                if keys is None or i >= len(keys) or c.key != keys[i] or c.ns != self.ns:
                    if keys is None and c.ns == self.ns and c.key in self.digests:
                        pass        # a mutated body still named published keys: judged below
                    else:
                        return f"frame {i} is key {c.key.hex()}, not the key asked for"
                want = self.digests.get(c.key)
                got = xxhash.xxh3_64_intdigest(memoryview(np.ascontiguousarray(c.kv).reshape(-1).view(np.uint8)))
                if want is not None and got != want:
                    return f"frame {i} (key {c.key.hex()}) differs from the published bytes"
                off, i = end, i + 1
        except KDNError as e:
            return f"a 200 fetch answer does not decode: {e}"
        return ""

    # --- driving ----------------------------------------------------------------------------
    def one(self, kind: str) -> str:
        case = self.case(kind)
        try:
            reply = self.send(case)
        except socket.timeout:
            reply, problem = None, f"no answer within {self.timeout_s} s"
        except (ValueError, OSError) as e:
            reply, problem = None, f"unreadable answer: {type(e).__name__}: {e}"
        else:
            problem = self.judge(case, reply)
        self.report.add(case.kind, "closed" if reply is None else reply.status)
        if problem:
            self.report.problems.append((case.kind, case.what, problem))
        return problem

    def run(self, cases: int = None, seconds: float = None, kinds=KINDS) -> Report:
        """Round-robin over kinds until `cases` cases or `seconds` seconds, whichever first."""
        if cases is None and seconds is None:
            raise KDNError("Fuzzer.run needs cases= or seconds=")
        t0 = time.monotonic()
        n = 0
        while (cases is None or n < cases) and (seconds is None or time.monotonic() - t0 < seconds):
            self.one(kinds[n % len(kinds)])
            n += 1
        self.report.seconds = time.monotonic() - t0
        return self.report

    def state(self) -> dict:
        """What the edge stores, as /health tells it: changed by nothing a fuzz case sends."""
        h = self.health()
        return {k: h.get(k) for k in ("ok", "chunks", "bytes", "hot_copies", "ring")}

    def check(self) -> str:
        """'' when /health is ok and a fetch of the KB still returns exactly the published bytes."""
        h = self.health()
        if not h.get("ok"):
            return f"/health is not ok after fuzzing: {h}"
        body, keys = self._valid_body(region=False)
        case = self._post("valid", "final valid fetch", "/v1/fetch", body, keys=keys, ok=(200,))
        reply = self.send(case)
        if reply is None or reply.status != 200:
            return f"the final valid fetch got {None if reply is None else reply.status}"
        n = int(reply.headers.get("x-kdn-chunks", -1))
        if n != len(keys):
            return f"the final valid fetch returned {n} of {len(keys)} chunks"
        return self._judge_frames(case, reply.body)
