"""An edge's KV events: what it holds and drops, published in vLLM's wire format.

A router outside KDN (vLLM's, llm-d's precise prefix-cache scorer, Dynamo's KV router)
subscribes to an edge as it would to a vLLM engine: ZMQ PUB frames `[topic, 8-byte
big-endian sequence number, msgpack(EventBatch)]`, the batch's events `BlockStored`,
`BlockRemoved` and `AllBlocksCleared` encoded exactly as `vllm.distributed.kv_events`
encodes them, and a ROUTER socket beside it that replays the batches a late subscriber
missed (ask with the first sequence number wanted, 8 bytes big-endian; the batches come
back as `[b"", topic, seq, payload]`, then `[b"", b"", -1, b""]`). Both sockets refuse
a frame over MAX_INBOUND bytes (ZMQ drops the peer before reading it). That bounds a frame,
not the frames of one message: libzmq queues a message's frames until its last arrives
(no socket option bounds their count), so a peer speaking ZMTP by hand could still send an
endless one; the sockets bind loopback only unless kv_events_remote is set.

What a chunk is announced as. Edges know keys, not tokens; manifests (which every edge
receives) carry both, so the publisher learns each key's tokens and position from them.
A chunk of 256 tokens is announced as 256/block_size blocks (block_size: what the
subscriber asks for, vLLM's default 16), each block's hash
`xxh3_128(hash of the block before ‖ its token ids as uint32 LE)`, chained from the
namespace digest: the rule of KDN's chunk keys at block granularity (at block_size 256 the
block hashes are the chunk keys). Routers recompute their own hashes from `token_ids`; the
announced hashes are ids that chain (`parent_block_hash` is the block before the chunk's
first, None at a KB's start) and that `BlockRemoved` names again. Only full blocks are
announced (as vLLM does): a KB's trailing partial chunk loses its last, partial block.
`medium` is `KDN/<tier>/<region>`, tier `memory` (main and hot) or `disk`.

Never on the edge's time. The tiers only note which keys changed (`note(key)`, a put on a
bounded queue: past its bound a note is dropped, counted, and the publisher thread later
resyncs by diffing everything held against what it announced). The thread reads the truth
itself (which tiers hold the key now, through their locks), diffs it against what it has
announced, hashes, encodes and sends. A key no manifest names yet waits (bounded) until its
manifest arrives. At start the thread sends `AllBlocksCleared` (a restarted edge forgets
what it held in memory) and then what it holds (its disk tier, rebuilt by scanning).

Encoding. vLLM has sent events as arrays (`array_like` structs: `["BlockStored", hashes,
parent, tokens, block_size, lora_id, medium]`, up to 0.11) and, since, as tagged maps
(`{"type": "BlockStored", "block_hashes": ..., ...}`); current routers read both. KDN sends
maps by default ("map"): the installed vLLM's own decoder reads only those, and a map names
its fields, so a consumer that knows other fields still decodes it. "array" is there for
consumers that only know the old layout. The batch itself is an array in both.
"""
import collections
import ipaddress
import queue
import threading
import time

import msgspec
import numpy as np
import xxhash

from kdn.core.checks import check_int
from kdn.core.errors import BadRequest
from kdn.core.keys import namespace_digest

DEFAULT_BLOCK_SIZE = 16          # vLLM's default block size
ENCODINGS = ("map", "array")
NOTE_QUEUE = 1 << 16             # changed keys waiting for the publisher thread, at most
WAITING_KEYS = 1 << 16           # keys held before their manifest arrived, at most
REPLAY_BATCHES = 10_000          # batches kept for replay (vLLM's default buffer_steps)
HWM = 100_000                    # ZMQ high-water mark of the PUB socket (vLLM's default)
# What a peer can make the edge hold. A replay request is 8 bytes and a subscription a topic
# (at most 256 characters) and a byte: ZMQ disconnects a peer whose frame is larger than
# MAX_INBOUND before it allocates the frame (ZMQ_MAXMSGSIZE, on both sockets: a PUB socket
# receives subscriptions). A 256 MiB frame to an unbounded socket cost the edge 300 MiB.
MAX_INBOUND = 4096
REPLAY_RCVHWM = 64               # replay requests queued per peer, at most
MAX_BATCH_KEYS = 4096            # notes one batch covers
BLOCK_CACHE = 64                 # manifests whose block hashes are kept
END_SEQ = (-1).to_bytes(8, "big", signed=True)
MEDIA = ("memory", "disk")


# --- vLLM's event classes (vllm/distributed/kv_events.py), field for field ------------------
class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list
    data_parallel_rank: "int | None" = None


class BlockStored(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    block_hashes: list
    parent_block_hash: "bytes | int | None"
    token_ids: list
    block_size: int
    lora_id: "int | None"
    medium: "str | None"
    lora_name: "str | None"


class BlockRemoved(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    block_hashes: list
    medium: "str | None"


class AllBlocksCleared(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


# the array layout vLLM sent up to 0.11 (array_like events: the tag first, then the fields)
class BlockStoredArray(msgspec.Struct, array_like=True, gc=False, tag="BlockStored"):
    block_hashes: list
    parent_block_hash: "bytes | int | None"
    token_ids: list
    block_size: int
    lora_id: "int | None"
    medium: "str | None"


class BlockRemovedArray(msgspec.Struct, array_like=True, gc=False, tag="BlockRemoved"):
    block_hashes: list
    medium: "str | None"


class AllBlocksClearedArray(msgspec.Struct, array_like=True, gc=False, tag="AllBlocksCleared"):
    pass


def _stored(encoding, hashes, parent, tokens, block_size, medium):
    if encoding == "array":
        return BlockStoredArray(hashes, parent, tokens, block_size, None, medium)
    return BlockStored(hashes, parent, tokens, block_size, None, medium, None)


def _removed(encoding, hashes, medium):
    return (BlockRemovedArray if encoding == "array" else BlockRemoved)(hashes, medium)


def _cleared(encoding):
    return AllBlocksClearedArray() if encoding == "array" else AllBlocksCleared()


# --- settings ----------------------------------------------------------------------------------
def _endpoint(endpoint, what: str, allow_remote: bool) -> tuple:
    """(host, port) of a tcp://HOST:PORT endpoint; BadRequest naming what is wrong."""
    if not isinstance(endpoint, str) or not endpoint.startswith("tcp://"):
        raise BadRequest(f"{what} must be tcp://HOST:PORT, got {endpoint!r:.80}")
    host, sep, port = endpoint[len("tcp://"):].rpartition(":")
    if not sep or not port.isdigit() or not 0 < int(port) < 65536:
        raise BadRequest(f"{what} must be tcp://HOST:PORT with a port in 1..65535, got {endpoint!r:.80}")
    if not allow_remote:
        try:
            loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
        except ValueError:
            loopback = False
        if not loopback:
            raise BadRequest(f"{what} {endpoint!r:.80}: KV events bind loopback only "
                             f"(127.0.0.0/8) unless kv_events_remote is set")
    return host, int(port)


def check_kv_events(options) -> "dict | None":
    """An edge's KV-event settings, checked: None (off), or a dict with endpoint (PUB,
    tcp://HOST:PORT), replay (the ROUTER endpoint; default the next port), block_size (a
    divisor of 256; default 16), topic (default ""), encoding ("map" or "array") and
    remote (allow a non-loopback host). A str is the endpoint alone."""
    if options is None:
        return None
    if isinstance(options, str):
        options = {"endpoint": options}
    if not isinstance(options, dict):
        raise BadRequest(f"kv_events must be an endpoint or a dict, got {type(options).__name__}")
    extra = set(options) - {"endpoint", "replay", "block_size", "topic", "encoding", "remote"}
    if extra:
        raise BadRequest(f"kv_events: unknown setting(s) {', '.join(sorted(map(str, extra)))}")
    remote = options.get("remote", False)
    if not isinstance(remote, bool):
        raise BadRequest(f"kv_events remote must be true or false, got {remote!r:.40}")
    host, port = _endpoint(options.get("endpoint"), "kv_events endpoint", remote)
    replay = options.get("replay") or f"tcp://{host}:{port + 1}"
    if port == 65535 and not options.get("replay"):
        raise BadRequest("kv_events endpoint port 65535 leaves no port for replay: name one")
    _, rport = _endpoint(replay, "kv_events replay endpoint", remote)
    if replay == options["endpoint"]:
        raise BadRequest(f"kv_events replay endpoint must differ from the PUB endpoint {replay}")
    bs = options.get("block_size", DEFAULT_BLOCK_SIZE)
    if check_int(bs, "kv_events block_size", 1, 256) and 256 % bs:
        raise BadRequest(f"kv_events block_size must divide 256 (1, 2, 4, ..., 256), got {bs!r:.40}")
    topic = options.get("topic", "")
    if not isinstance(topic, str) or len(topic) > 256:
        raise BadRequest(f"kv_events topic must be a str of at most 256 characters, got {topic!r:.40}")
    enc = options.get("encoding", "map")
    if enc not in ENCODINGS:
        raise BadRequest(f"kv_events encoding must be one of {', '.join(ENCODINGS)}, got {enc!r:.40}")
    return {"endpoint": options["endpoint"], "replay": replay, "block_size": bs, "topic": topic,
            "encoding": enc, "remote": remote}


def offset_ports(options: "dict | None", k: int) -> "dict | None":
    """The settings of the k-th edge started from one `--kv-events` endpoint: its PUB port
    is PORT + 2k, its replay port PORT + 2k + 1 (edges in the topology's order)."""
    o = check_kv_events(options)
    if o is None:
        return None
    host, port = _endpoint(o["endpoint"], "kv_events endpoint", o["remote"])
    if port + 2 * k + 1 > 65535:
        raise BadRequest(f"kv_events endpoint port {port}: edge {k} would need port {port + 2 * k + 1}")
    return dict(o, endpoint=f"tcp://{host}:{port + 2 * k}", replay=f"tcp://{host}:{port + 2 * k + 1}")


# --- block hashes ------------------------------------------------------------------------------
class Blocks:
    """Each known chunk's blocks: token ids, block hashes, parent; learned from manifests.
    Used by the publisher thread only."""

    def __init__(self, block_size: int):
        self.bs = block_size
        self.where = {}          # key -> (manifest id, stream, chunk index in the stream)
        self.manifests = {}      # manifest id -> (tokens uint32, streams [(ns, start, end, ct)])
        self._hashes = collections.OrderedDict()   # (manifest id, stream) -> list of block hashes
        self._ids = 0

    def learn(self, m: dict) -> list:
        """Index manifest m's keys; the keys it names."""
        keys = list(m.get("keys") or ())
        tokens = np.frombuffer(m.get("tokens") or b"", dtype="<u4")
        if not keys or len(tokens) != m.get("n_tokens"):
            return []            # a manifest without its tokens: nothing to announce
        ns, ct = namespace_digest(m["tenant"], m["fingerprint"]), m["chunk_tokens"]
        if m.get("layout") == "segments":
            streams = [(ns, d["start"], d["end"], d["first_chunk"]) for d in m["documents"]]
        else:
            streams = [(ns, 0, len(tokens), 0)]
        self._ids += 1
        mid = self._ids
        self.manifests[mid] = (tokens, streams, ct)
        for s, (_, start, end, first) in enumerate(streams):
            for i in range(-(-(end - start) // ct)):
                if first + i < len(keys):
                    self.where.setdefault(keys[first + i], (mid, s, i))
        return keys

    def knows(self, key) -> bool:
        return key in self.where

    def _stream_hashes(self, mid, s) -> list:
        got = self._hashes.get((mid, s))
        if got is None:
            tokens, streams, _ = self.manifests[mid]
            h, start, end, _ = streams[s]
            raw = memoryview(np.ascontiguousarray(tokens[start:end])).cast("B")
            got, step = [], 4 * self.bs
            for off in range(0, (end - start) // self.bs * step, step):
                h = xxhash.xxh3_128_digest(h + raw[off:off + step])
                got.append(h)
            self._hashes[(mid, s)] = got
            while len(self._hashes) > BLOCK_CACHE:
                self._hashes.popitem(last=False)
        else:
            self._hashes.move_to_end((mid, s))
        return got

    def of(self, key) -> tuple:
        """(block hashes, parent hash or None, token ids) of key's full blocks."""
        mid, s, i = self.where[key]
        tokens, streams, ct = self.manifests[mid]
        _, start, end, _ = streams[s]
        hashes = self._stream_hashes(mid, s)
        per = ct // self.bs
        lo, hi = i * per, min((i + 1) * per, len(hashes))
        toks = tokens[start + lo * self.bs:start + hi * self.bs].tolist()
        return hashes[lo:hi], (hashes[lo - 1] if lo > 0 else None), toks


# --- the publisher -----------------------------------------------------------------------------
class KVEvents:
    """One edge's publisher: note(key) from any thread; a daemon thread does the rest.

    where(key) -> (in memory, on disk), read through the tiers' locks; held() -> every key
    held now (for a resync). Counters in `counters` (kv_events_*), copied by snapshot()."""

    def __init__(self, options: dict, region: str, where, held):
        o = check_kv_events(options)
        self.options, self.region = o, region
        self.topic = o["topic"].encode()
        self.encoding, self.block_size = o["encoding"], o["block_size"]
        self.medium = {t: f"KDN/{t}/{region}" for t in MEDIA}
        self._where, self._held = where, held
        self.blocks = Blocks(self.block_size)
        self.announced = {}                       # key -> (in memory, on disk) as announced
        self.waiting = collections.OrderedDict()  # keys held before their manifest came
        self._notes = queue.Queue(NOTE_QUEUE)
        self._manifests = collections.deque()     # manifests to learn (deque: thread-safe)
        self._resync = True                       # the first batch announces what is held
        self._buffer = collections.deque(maxlen=REPLAY_BATCHES)
        self._seq = 0
        self._lock = threading.Lock()             # guards counters
        self.counters = collections.Counter()
        import zmq
        self._zmq = zmq
        self._ctx = zmq.Context.instance()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(HWM)
        self._replay = self._ctx.socket(zmq.ROUTER)
        for sock in (self._pub, self._replay):     # before bind: a connection takes them then
            sock.setsockopt(zmq.MAXMSGSIZE, MAX_INBOUND)
        self._replay.setsockopt(zmq.RCVHWM, REPLAY_RCVHWM)
        try:
            self._pub.bind(o["endpoint"])
            self._replay.bind(o["replay"])
        except zmq.ZMQError as e:
            self._pub.close(linger=0)
            self._replay.close(linger=0)
            raise BadRequest(f"kv_events: cannot bind {o['endpoint']} / {o['replay']}: {e}") from None
        self._running = True
        self._thread = threading.Thread(target=self._run, daemon=True, name="kdn-kv-events")
        self._thread.start()

    # --- the edge's side (any thread, never blocks) -----------------------------------------
    def note(self, key) -> None:
        """key's holdings may have changed."""
        try:
            self._notes.put_nowait(key)
        except queue.Full:
            self._resync = True
            self._count("kv_events_notes_dropped")

    def learn(self, m: dict) -> None:
        """A manifest the edge received (its tokens say what its keys are)."""
        self._manifests.append(m)

    def close(self) -> None:
        self._running = False
        self._thread.join(5)
        self._pub.close(linger=0)
        self._replay.close(linger=0)

    # --- the thread -----------------------------------------------------------------------
    def _run(self):
        # Survives what a batch can meet (a socket error, an event that does not encode): a
        # publisher that died would leave routers with a stale picture forever. Counted and
        # logged, and the next batch resyncs everything. Anything else is a bug and surfaces.
        import logging

        import zmq
        log = logging.getLogger("kdn.edge.events")
        first = True
        while self._running:
            try:
                if self._replay.poll(0):
                    self._serve_replay()
                keys = self._take()
                events = [_cleared(self.encoding)] if first else []
                first = False
                events += self._events(keys)
                if events:
                    self._send(events)
            except (zmq.ZMQError, msgspec.EncodeError, OSError):
                self._resync = True
                self._count("kv_events_errors")
                log.exception("KV events: a batch failed; resyncing")
                time.sleep(0.1)

    def _take(self) -> list:
        """Notes waiting now (at least one, or none after 50 ms), manifests learned first."""
        try:
            keys = [self._notes.get(timeout=0.05)]
        except queue.Empty:
            keys = []
        while len(keys) < MAX_BATCH_KEYS:
            try:
                keys.append(self._notes.get_nowait())
            except queue.Empty:
                break
        while self._manifests:
            for k in self.blocks.learn(self._manifests.popleft()):
                if self.waiting.pop(k, None) is not None:
                    keys.append(k)
        if self._resync:
            self._resync = False
            self._count("kv_events_resyncs")
            keys += list(self._held()) + list(self.announced) + list(self.waiting)
        return list(dict.fromkeys(keys))

    def _events(self, keys) -> list:
        stored = {t: [] for t in MEDIA}
        removed = {t: [] for t in MEDIA}
        for key in keys:
            now = tuple(bool(x) for x in self._where(key))
            was = self.announced.get(key, (False, False))
            if now == was:
                continue
            if not self.blocks.knows(key):
                if any(now):
                    self.waiting[key] = True
                    self.waiting.move_to_end(key)
                    while len(self.waiting) > WAITING_KEYS:
                        self.waiting.popitem(last=False)
                        self._count("kv_events_waiting_dropped")
                    self._count("kv_events_waiting")
                else:
                    self.waiting.pop(key, None)
                continue
            for t, n, w in zip(MEDIA, now, was):
                if n and not w:
                    stored[t].append(key)
                elif w and not n:
                    removed[t].append(key)
            if any(now):
                self.announced[key] = now
            else:
                self.announced.pop(key, None)
        events = []
        for t in MEDIA:
            for key in removed[t]:
                hashes, _, _ = self.blocks.of(key)
                if hashes:
                    events.append(_removed(self.encoding, hashes, self.medium[t]))
            for key in stored[t]:
                hashes, parent, toks = self.blocks.of(key)
                if hashes:
                    events.append(_stored(self.encoding, hashes, parent, toks, self.block_size,
                                          self.medium[t]))
            self._count(f"kv_events_stored_{t}", len(stored[t]))
            self._count(f"kv_events_removed_{t}", len(removed[t]))
        return events

    def _send(self, events) -> None:
        payload = msgspec.msgpack.encode(EventBatch(ts=time.time(), events=events))
        seq = self._seq
        self._seq += 1
        self._pub.send_multipart((self.topic, seq.to_bytes(8, "big"), payload))
        self._buffer.append((seq, payload))
        self._count("kv_events_batches")
        self._count("kv_events_sent", len(events))

    def _serve_replay(self) -> None:
        frame = self._replay.recv_multipart()
        if len(frame) != 3 or len(frame[2]) != 8:
            self._count("kv_events_replay_refused")
            return
        client, _, start = frame
        start = int.from_bytes(start, "big")
        for seq, payload in list(self._buffer):
            if seq >= start:
                self._replay.send_multipart((client, b"", self.topic, seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((client, b"", b"", END_SEQ, b""))
        self._count("kv_events_replays")

    # --- counters ---------------------------------------------------------------------------
    def _count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self.counters[name] += n

    def snapshot(self) -> dict:
        """The counters, copied under the lock (the publisher thread updates them)."""
        with self._lock:
            return dict(self.counters, kv_events_queued=self._notes.qsize())
