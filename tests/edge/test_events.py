"""KV events out of an edge, read by a consumer no one here wrote: vLLM's own event classes
(`vllm.distributed.kv_events`: KVEventBatch and its events, decoded with msgspec) over a
real ZMQ SUB socket, and a DEALER asking the replay socket for what it missed.

First an edge in this process (no Ray: its tiers driven directly): a publish, an eviction
to the disk tier, a drop, a chunk held before its manifest, the array encoding, a note
queue that overflowed, bad settings. Then a real network (one edge per region, each on its
own port): the events of every edge match what it holds after a publish, and an edge killed
and restarted starts over with AllBlocksCleared and announces what it holds again.
"""
import time

import msgspec
import numpy as np
import pytest
import ray
import xxhash
import zmq
from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch

from kdn.launch.cluster import free_ports
from kdn.edge import events as ev
from kdn.core.errors import BadRequest
from kdn.core.keys import chunk_keys, namespace_digest

VLLM = msgspec.msgpack.Decoder(type=KVEventBatch)
BS = 16


class Subscriber:
    """A router's view of one edge: SUB to its PUB, DEALER to its replay socket; every frame
    decoded with vLLM's decoder and applied to {medium: set of block hashes}."""

    def __init__(self, endpoint, replay, topic=b""):
        ctx = zmq.Context.instance()
        self.sub = ctx.socket(zmq.SUB)
        self.sub.connect(endpoint)
        self.sub.setsockopt(zmq.SUBSCRIBE, topic)
        self.replay_at = replay
        self.frames, self.held = [], {}
        self.next_seq = 0

    def apply(self, seq, batch):
        for e in batch.events:
            if isinstance(e, AllBlocksCleared):
                self.held.clear()
            elif isinstance(e, BlockStored):
                self.held.setdefault(e.medium, set()).update(e.block_hashes)
            elif isinstance(e, BlockRemoved):
                self.held.setdefault(e.medium, set()).difference_update(e.block_hashes)
        self.next_seq = seq + 1

    def drain(self, quiet_s=0.4, timeout_s=20.0, until=None):
        """Receive until nothing came for quiet_s (and until(self) holds, when given). Batches
        sent before this SUB socket joined (ZMQ's slow joiner: a busy machine) or lost in
        between come from the replay socket, in order, as a router gets them."""
        t0 = last = time.monotonic()
        while time.monotonic() - t0 < timeout_s:
            if self.sub.poll(50):
                topic, seq, payload = self.sub.recv_multipart()
                assert len(seq) == 8
                seq = int.from_bytes(seq, "big")
                if seq > self.next_seq:          # a gap: the replay socket has what it missed
                    for s, b in self.replay(self.next_seq):
                        if s < seq:
                            self.frames.append((topic, s, b))
                            self.apply(s, b)
                batch = VLLM.decode(payload)
                self.frames.append((topic, seq, batch))
                self.apply(seq, batch)
                last = time.monotonic()
            elif time.monotonic() - last > quiet_s and (until is None or until(self)):
                return self
        raise AssertionError(f"events did not settle in {timeout_s} s: {self.held}")

    def replay(self, start: int) -> list:
        """(seq, batch) of every buffered batch from start, as the replay socket sends them."""
        d = zmq.Context.instance().socket(zmq.DEALER)
        d.connect(self.replay_at)
        d.send_multipart((b"", start.to_bytes(8, "big")))
        out = []
        try:
            while True:
                assert d.poll(5000), "the replay socket did not answer"
                _, topic, seq, payload = d.recv_multipart()
                if seq == ev.END_SEQ:
                    return out
                out.append((int.from_bytes(seq, "big"), VLLM.decode(payload)))
        finally:
            d.close(linger=0)

    def close(self):
        self.sub.close(linger=0)


def block_hashes(tokens, ns, bs=BS) -> list:
    """What a router recomputes: the chain at block granularity, from the namespace."""
    raw, h, out = np.asarray(tokens, "<u4").tobytes(), ns, []
    for off in range(0, len(tokens) // bs * bs * 4, bs * 4):
        h = xxhash.xxh3_128_digest(h + raw[off:off + bs * 4])
        out.append(h)
    return out


def manifest(tokens, ns_parts=("default", "edge-unit"), ct=64, name="kb") -> dict:
    ns = namespace_digest(*ns_parts)
    toks = np.asarray(tokens, "<u4")
    return dict(name=name, version=1, tenant=ns_parts[0], fingerprint=ns_parts[1], layout="prefix",
                chunk_tokens=ct, n_tokens=len(toks), documents=[], keys=chunk_keys(toks, ns, ct),
                tokens=toks.tobytes())


def chunks_for(kit, m, seed=0):
    """Chunks (synthetic KV, 64 tokens each) under m's keys, in order."""
    from kdn.core.chunk import Chunk
    rng = np.random.default_rng(seed)
    return [Chunk(k, kit.NS, rng.standard_normal((2, 2, 2, 64, 64)).astype(np.float32), "float32")
            for k in m["keys"]]


def blocks_of(m, keys, bs=BS) -> set:
    """The block hashes of m's chunks named by keys (full blocks only)."""
    toks = np.frombuffer(m["tokens"], "<u4")
    hashes = block_hashes(toks, namespace_digest(m["tenant"], m["fingerprint"]), bs)
    per = m["chunk_tokens"] // bs
    idx = [m["keys"].index(k) for k in keys]
    return {h for i in idx for h in hashes[i * per:(i + 1) * per]}


# vLLM 0.11's event classes (array_like events), for the "array" encoding
class OldStored(msgspec.Struct, array_like=True, omit_defaults=True, tag="BlockStored"):
    block_hashes: list
    parent_block_hash: "bytes | None"
    token_ids: list
    block_size: int
    lora_id: "int | None"
    medium: "str | None"


class OldCleared(msgspec.Struct, array_like=True, tag="AllBlocksCleared"):
    pass


class OldBatch(msgspec.Struct, array_like=True, omit_defaults=True):
    ts: float
    events: "list[OldStored | OldCleared]"
    data_parallel_rank: "int | None" = None


@pytest.fixture
def edge_with_events(kit):
    made = []

    def make(**options):
        pub, replay = (f"tcp://127.0.0.1:{p}" for p in free_ports(2))
        kv = {"endpoint": pub, "replay": replay, **options.pop("kv", {})}
        edge = kit.local_edge(kv_events=kv, **options)
        sub = Subscriber(pub, replay)
        made.append((edge, sub))
        time.sleep(0.3)                 # the SUB connects before anything is published
        return edge, sub
    yield make
    for edge, sub in made:
        sub.close()
        edge.events.close()


# --- an edge in this process ---------------------------------------------------------------------
def test_a_publish_is_announced_as_vllm_blocks_a_router_can_recompute(kit, edge_with_events):
    edge, sub = edge_with_events()
    m = manifest(range(1000, 1000 + 4 * 64 + 40))         # 4 full chunks and a 40-token one
    edge.catalog.add(m)
    for c in chunks_for(kit, m):
        edge.tiers.put("main", c.key, kit.held(c))
    sub.drain(until=lambda s: len(s.held.get("KDN/memory/here", ())) == 4 * 4 + 2)
    assert isinstance(sub.frames[0][2].events[0], AllBlocksCleared) and sub.frames[0][1] == 0
    assert [f[1] for f in sub.frames] == list(range(len(sub.frames)))      # seq 0, 1, 2, ...
    stored = [e for f in sub.frames for e in f[2].events if isinstance(e, BlockStored)]
    assert [len(e.block_hashes) for e in stored] == [4, 4, 4, 4, 2]     # 40 tokens: 2 full blocks
    toks = np.frombuffer(m["tokens"], "<u4")
    want = block_hashes(toks, namespace_digest("default", "edge-unit"))
    assert [h for e in stored for h in e.block_hashes] == want
    assert [h for e in stored for h in e.token_ids] == toks[:len(want) * BS].tolist()
    assert stored[0].parent_block_hash is None
    assert [e.parent_block_hash for e in stored[1:]] == [e.block_hashes[-1] for e in stored[:-1]]
    assert {(e.block_size, e.medium, e.lora_id) for e in stored} == {(16, "KDN/memory/here", None)}
    assert edge.all_counters()["kv_events_stored_memory"] == 5
    # a replay from seq 1 returns every batch after the first, byte for byte decoded alike
    assert [(s, b.events) for s, b in sub.replay(1)] == [(s, b.events) for _, s, b in sub.frames[1:]]


def test_at_block_size_256_the_block_hashes_are_kdn_chunk_keys(kit, edge_with_events):
    edge, sub = edge_with_events(kv={"block_size": 256})
    m = manifest(range(5000, 5000 + 512), ct=256)
    edge.catalog.add(m)
    for c in chunks_for(kit, m):
        edge.tiers.put("main", c.key, kit.held(c))
    sub.drain(until=lambda s: len(s.held.get("KDN/memory/here", ())) == 2)
    assert sub.held["KDN/memory/here"] == set(m["keys"])


def test_eviction_to_disk_and_a_drop_follow_the_tiers(kit, edge_with_events, tmp_path, loop):
    # memory holds 2 chunks (main 3/4 of the capacity): the rest go to the disk tier
    c0 = kit.make_chunks(1, tokens=64)[0]
    edge, sub = edge_with_events(capacity_bytes=int(c0.nbytes * 3.9), disk_bytes=64 << 20,
                                 disk_dir=str(tmp_path))
    m = manifest(range(64 * 6))
    edge.catalog.add(m)
    chunks = chunks_for(kit, m)
    for c in chunks:      # one at a time, each announced before the next evicts (notes of
        edge.tiers.put("main", c.key, kit.held(c))        # one batch coalesce)
        loop.run(edge.tiers.drain_write_backs(edge.forms.intact))
        sub.drain(quiet_s=0.15)
    in_memory = [c.key for c in chunks if edge.tiers.peek(c.key) is not None]
    on_disk = [c.key for c in chunks if c.key in edge.tiers.disk]
    assert len(in_memory) == 2 and len(on_disk) == 4
    want = {"KDN/memory/here": blocks_of(m, in_memory), "KDN/disk/here": blocks_of(m, on_disk)}
    sub.drain(until=lambda s: s.held == want)
    removed = [e for f in sub.frames for e in f[2].events if isinstance(e, BlockRemoved)]
    assert {e.medium for e in removed} == {"KDN/memory/here"}
    loop.run(edge.tiers.drop([in_memory[0]]))
    loop.run(edge.tiers.drop([on_disk[0]]))
    want = {"KDN/memory/here": blocks_of(m, in_memory[1:]), "KDN/disk/here": blocks_of(m, on_disk[1:])}
    sub.drain(until=lambda s: s.held == want)


def test_a_chunk_held_before_its_manifest_is_announced_when_the_manifest_comes(kit, edge_with_events):
    edge, sub = edge_with_events()
    m = manifest(range(300, 300 + 128))
    for c in chunks_for(kit, m):
        edge.tiers.put("main", c.key, kit.held(c))
    sub.drain()
    assert sub.held == {} and edge.events.snapshot()["kv_events_waiting"] == 2
    edge.catalog.add(m)
    sub.drain(until=lambda s: s.held == {"KDN/memory/here": blocks_of(m, m["keys"])})


def test_the_array_encoding_is_vllm_011s_layout(kit, edge_with_events):
    """What vLLM sent up to 0.11 (array_like events), decoded with those classes' layout."""
    edge, sub = edge_with_events(kv={"encoding": "array"})
    m = manifest(range(64))
    edge.catalog.add(m)
    edge.tiers.put("main", m["keys"][0], kit.held(chunks_for(kit, m)[0]))
    time.sleep(1.0)
    frames = []
    while sub.sub.poll(200):
        frames.append(msgspec.msgpack.Decoder(OldBatch).decode(sub.sub.recv_multipart()[2]))
    events = [e for b in frames for e in b.events]
    assert isinstance(events[0], OldCleared) and isinstance(events[1], OldStored)
    assert events[1].block_hashes == block_hashes(range(64), namespace_digest("default", "edge-unit"))
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(events[1]))[0] == "BlockStored"


def test_a_note_queue_that_overflowed_is_resynced(kit, edge_with_events, monkeypatch):
    monkeypatch.setattr(ev, "NOTE_QUEUE", 4)
    edge, sub = edge_with_events()
    m = manifest(range(64 * 12))
    edge.catalog.add(m)
    for c in chunks_for(kit, m):      # the thread may keep up with some: at least none is lost
        edge.tiers.put("main", c.key, kit.held(c))
    sub.drain(until=lambda s: s.held == {"KDN/memory/here": blocks_of(m, edge.tiers.main.keys())})


@pytest.mark.parametrize("bad, message", [
    ("tcp://10.1.2.3:5557", "loopback only"),
    ("tcp://0.0.0.0:5557", "loopback only"),
    ("ipc:///tmp/x", "tcp://HOST:PORT"),
    ({"endpoint": "tcp://127.0.0.1:5557", "block_size": 48}, "must divide 256"),
    ({"endpoint": "tcp://127.0.0.1:5557", "encoding": "json"}, "encoding must be one of"),
    ({"endpoint": "tcp://127.0.0.1:5557", "port": 1}, "unknown setting"),
])
def test_bad_settings_are_refused_naming_the_problem(bad, message):
    with pytest.raises(BadRequest, match=message):
        ev.check_kv_events(bad)


def test_edges_of_one_endpoint_get_ports_two_apart():
    got = [ev.offset_ports("tcp://127.0.0.1:6000", k) for k in range(3)]
    assert [(g["endpoint"], g["replay"]) for g in got] == [
        ("tcp://127.0.0.1:6000", "tcp://127.0.0.1:6001"), ("tcp://127.0.0.1:6002", "tcp://127.0.0.1:6003"),
        ("tcp://127.0.0.1:6004", "tcp://127.0.0.1:6005")]
    assert ev.check_kv_events({"endpoint": "tcp://10.0.0.1:7000", "remote": True})["replay"] == "tcp://10.0.0.1:7001"


def test_a_port_in_use_is_a_clear_error(kit):
    import socket
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    with pytest.raises(BadRequest, match="cannot bind"):
        kit.local_edge(kv_events=f"tcp://127.0.0.1:{s.getsockname()[1]}")
    s.close()


# --- what a peer can make the edge hold ---------------------------------------------------------------
EVENTS_ALONE = """
import sys
import time
from kdn.edge.events import KVEvents
ev = KVEvents({"endpoint": sys.argv[1], "replay": sys.argv[2]}, "here", lambda k: (False, False), lambda: ())
while not ev.snapshot().get("kv_events_batches"):      # its first batch (AllBlocksCleared) is out
    time.sleep(0.01)
print("ready", flush=True)
sys.stdin.read()
ev.close()
"""


def _peak_rss_mib(pid) -> float:
    """A process's peak resident set (VmHWM), MiB: a frame held for a moment counts too."""
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) / 1024


def test_large_frames_to_the_replay_and_pub_sockets_do_not_grow_the_edge():
    """Three DEALERs each send one 256 MiB frame to the replay socket (and a SUB one to the
    PUB socket): the edge's publisher, alone in its own process, keeps its peak memory
    flat, and a replay request from each of them after is still answered."""
    import subprocess
    import sys
    pub, replay = (f"tcp://127.0.0.1:{p}" for p in free_ports(2))
    proc = subprocess.Popen([sys.executable, "-c", EVENTS_ALONE, pub, replay],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    ctx = zmq.Context.instance()
    socks = []
    try:
        assert proc.stdout.readline().strip() == "ready"
        sub = Subscriber(pub, replay)
        socks.append(sub.sub)
        assert [isinstance(b.events[0], AllBlocksCleared) for _, b in sub.replay(0)] == [True]
        before = _peak_rss_mib(proc.pid)
        big = bytes(256 << 20)                 # one buffer, shared by every send (copy=False)
        trackers = []
        for _ in range(3):
            d = ctx.socket(zmq.DEALER)
            socks.append(d)
            d.connect(replay)
            d.send(b"", zmq.SNDMORE)
            trackers.append(d.send(big, copy=False, track=True))
            d.send_multipart((b"", (0).to_bytes(8, "big")))   # a request after it, same peer
        s = ctx.socket(zmq.XSUB)          # a subscription is a frame the PUB socket receives
        socks.append(s)
        s.connect(pub)
        s.send(big, copy=False)
        for t in trackers:
            t.wait(30)                    # every byte of the frame left this process
        for d in socks[1:4]:              # the edge read (or refused) the frame: it answers
            got = []                      # the request behind it
            while not got or got[-1][2] != ev.END_SEQ:
                assert d.poll(10_000), "the replay socket did not answer after a large frame"
                got.append(d.recv_multipart())
            assert len(got) == 2 and got[0][2] == (0).to_bytes(8, "big")
        grew = _peak_rss_mib(proc.pid) - before
        assert grew < 32, f"the edge's peak memory grew by {grew:.0f} MiB"
        assert proc.poll() is None
    finally:
        for so in socks:
            so.close(linger=0)
        proc.stdin.close()
        proc.wait(10)


# --- a real network ---------------------------------------------------------------------------------
N_TOKENS = 1024 + 100             # 4 full chunks and one of 100 tokens


def free_run(n: int) -> int:
    """A port p with p .. p+n-1 free now."""
    import socket
    rng = np.random.default_rng()
    while True:
        base, socks = int(rng.integers(20000, 60000)), []
        try:
            for p in range(base, base + n):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", p))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()


@pytest.fixture(scope="module")
def net(small_network):
    base = free_run(6)
    n = small_network(edge_options={"kv_events": f"tcp://127.0.0.1:{base}", "membership_refresh_s": 1.0})
    n.subs = {}
    for k, e in enumerate(n.topology.edges):
        n.subs[e.name] = Subscriber(f"tcp://127.0.0.1:{base + 2 * k}", f"tcp://127.0.0.1:{base + 2 * k + 1}")
    time.sleep(0.5)
    yield n
    for s in n.subs.values():
        s.close()


def _held_blocks(n, name, m) -> set:
    """Blocks of m's chunks the edge holds now (memory or disk), asked over Ray."""
    admin = None
    held = ray.get(n.edge(name).have.remote(m["keys"], token=admin), timeout=30)
    return blocks_of(m, [k for k, h in zip(m["keys"], held) if h])


def test_events_match_what_every_edge_holds_after_a_publish(net, synth):
    from kdn.client import Client
    toks = synth.tokens(N_TOKENS, seed=3)
    cl = Client(network=net.name, region="us-east", tenant="default", fingerprint="synthetic-events")
    cl.publish("kb", [("d", toks)], synth.kv(N_TOKENS, seed=3))
    mf = cl.manifest("kb")
    m = dict(tenant="default", fingerprint="synthetic-events", chunk_tokens=256, keys=list(mf.keys),
             tokens=np.asarray(toks, "<u4").tobytes())
    total = 0
    for name, sub in net.subs.items():
        want = _held_blocks(net, name, m)
        region = net.topology.region_of(name)
        sub.drain(until=lambda s: s.held.get(f"KDN/memory/{region}", set()) == want)
        total += len(want)
    assert total >= len(blocks_of(m, m["keys"]))         # every chunk on at least one edge
    net.m = m


def test_a_killed_edge_starts_over_and_announces_what_it_holds(net):
    m = net.m
    name = net.topology.edges[0].name
    region = net.topology.region_of(name)
    sub = net.subs[name]
    before = len(sub.frames)
    first_pid = ray.get(net.edge(name).ping.remote(), timeout=30)["pid"]
    ray.kill(net.edge(name), no_restart=False)
    t0 = time.monotonic()
    while True:
        assert time.monotonic() - t0 < 60, "the edge did not come back"
        try:
            if ray.get(net.edge(name).ping.remote(), timeout=5)["pid"] != first_pid:
                break
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
            pass
        time.sleep(0.5)
    # Its memory is gone. Its new publisher started over at seq 0 with AllBlocksCleared,
    # perhaps before this SUB socket reconnected: a router that sees the sequence restart
    # (or a gap) asks the replay socket, and rebuilds what the edge holds from seq 0.
    time.sleep(1.0)
    replayed = sub.replay(0)
    assert replayed[0][0] == 0 and isinstance(replayed[0][1].events[0], AllBlocksCleared)
    fresh = Subscriber(sub.replay_at.replace(str(int(sub.replay_at.rsplit(":", 1)[1])),
                                             str(int(sub.replay_at.rsplit(":", 1)[1]) - 1)),
                       sub.replay_at)
    try:
        for seq, batch in replayed:
            fresh.apply(seq, batch)
        fresh.drain(until=lambda s: s.held.get(f"KDN/memory/{region}", set()) == _held_blocks(net, name, m))
    finally:
        fresh.close()
    assert len(sub.frames) >= before


def test_the_topology_file_names_an_edges_kv_events_and_round_trips(tmp_path):
    from kdn.core.errors import TopologyError
    from kdn.edge.options import check_edge_options
    from kdn.placement.topology import Topology
    t = Topology.default_local(["here"], capacity_bytes=1 << 20).to_dict()
    t["regions"]["here"]["edges"][0]["kv_events"] = {"endpoint": "tcp://127.0.0.1:5601", "block_size": 32}
    topo = Topology.from_dict(t)
    name = topo.edges[0].name
    assert topo.edge_options(name)["kv_events"] == {"endpoint": "tcp://127.0.0.1:5601", "block_size": 32}
    (tmp_path / "t.toml").write_text(topo.to_toml())
    assert Topology.from_toml(tmp_path / "t.toml").edge_options(name) == topo.edge_options(name)
    t["regions"]["here"]["edges"][0]["kv_events"] = 5601
    bad = Topology.from_dict(t)             # placement keeps it as written; the edge refuses it
    with pytest.raises(TopologyError, match="kv_events: must be an endpoint"):
        check_edge_options(bad.edge_options(name), "t.toml: edge")
