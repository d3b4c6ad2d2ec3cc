"""An edge's Prometheus metrics: a prometheus_client collector over its counters.

Every component of an edge keeps its own `counters` (a collections.Counter); at scrape time
this collector reads them, and the tiers' sizes, into metric families. One CollectorRegistry
per edge, never the library's global one, so two edges in one process never share a metric.
The named families are the ones dashboards use; kdn_edge_events_total carries every counter
besides, by name, except those that depend on other tenants' data (HIDDEN): /metrics needs
no token, and must not tell a stranger whether another tenant's keys exist.
The conversation tier reports its bytes per tenant and per tier (memory, disk), reads,
disk reads, moves to disk, expiries and evictions, and a pinned tenant's chunks sent to and
read back from the origin (kdn_edge_conversation_*). An edge with a disk tier reports it as tier "disk" beside main and hot (chunks, bytes,
capacity, hits, evictions), and its write-backs: written, and dropped (device full, or the
queue to the disk full).
"""
from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from kdn.core.names import SOURCE_KINDS
from kdn.edge.tiers import ROLES

LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
                   2.5, 5.0, 10.0)
HIDDEN = frozenset({"namespace_refused"})     # counted for the operator (stats), not exported
TIER_OPS = ("gets", "hits", "misses", "puts", "rejected", "evictions")


def _counter(name, doc, value=None, labels=(), samples=()):
    m = CounterMetricFamily(name, doc, value=value, labels=labels or None)
    for label_values, v in samples:
        m.add_metric(label_values, v)
    return m


def _gauge(name, doc, value=None, labels=(), samples=()):
    m = GaugeMetricFamily(name, doc, value=value, labels=labels or None)
    for label_values, v in samples:
        m.add_metric(label_values, v)
    return m


class EdgeCollector:
    """Metric families of one edge (its node and, when it serves HTTP, its HTTP server)."""

    def __init__(self, edge, http=None):
        self.edge, self.http = edge, http

    def collect(self):
        e, c = self.edge, self.edge.all_counters()
        tiers = {t: e.tiers.tier(t).stats() for t in ROLES}
        if e.tiers.disk is not None:
            tiers["disk"] = e.tiers.disk.stats()
        loop = getattr(self.http, "loop_class", None) or ""
        yield _gauge("kdn_edge_info", "This edge: name and region.", labels=("edge", "region", "loop"),
                     samples=[((e.name, e.region, loop), 1)])
        yield _counter("kdn_edge_hits_total", "Chunks served from this edge's own tiers.",
                       labels=("tier",), samples=[((t,), c[t + "_hits"]) for t in tiers])
        yield _counter("kdn_edge_chunks_served_total", "Chunks served, by where they came from.",
                       labels=("source",), samples=[((s,), c["served_" + s])
                                                     for s in SOURCE_KINDS])
        yield _counter("kdn_edge_bytes_served_total", "KV bytes served over any transport.",
                       value=c["bytes_served"])
        yield _counter("kdn_edge_fetches_total", "Fetch requests over any transport.", value=c["fetches"])
        yield _counter("kdn_edge_hot_promoted_total", "Chunks copied into the hot tier.",
                       value=c["hot_promoted"])
        yield _counter("kdn_edge_loads_total", "Pull-through loads made (singleflight).",
                       value=c["loads"])
        yield _counter("kdn_edge_loads_deduped_total", "Keys that joined a load already in "
                       "flight instead of causing one.", value=c["loads_deduped"])
        yield _gauge("kdn_edge_hot_copies", "Chunks held in the hot tier.", value=tiers["hot"]["items"])
        yield _gauge("kdn_edge_chunks", "Chunks held, by tier.", labels=("tier",),
                     samples=[((t,), tiers[t]["items"]) for t in tiers])
        yield _gauge("kdn_edge_bytes", "Bytes held, by tier.", labels=("tier",),
                     samples=[((t,), tiers[t]["bytes"]) for t in tiers])
        yield _gauge("kdn_edge_capacity_bytes", "Byte capacity, by tier.", labels=("tier",),
                     samples=[((t,), tiers[t]["capacity"]) for t in tiers])
        yield _counter("kdn_edge_evictions_total", "Chunks evicted, by tier.", labels=("tier",),
                       samples=[((t,), tiers[t]["evictions"]) for t in tiers])
        if "disk" in tiers:
            yield _counter("kdn_edge_write_backs_total", "Chunks written to the disk tier "
                           "(memory's victims and pulled-through fills).", labels=("tier",),
                           samples=[(("disk",), c["disk_writes"])])
            yield _counter("kdn_edge_write_backs_dropped_total", "Write-backs to the disk tier "
                           "dropped: the device was full, or the queue to it was.",
                           labels=("tier", "reason"),
                           samples=[(("disk", "full"), c["disk_full_dropped"]),
                                    (("disk", "busy"), c["disk_write_back_dropped_busy"])])
        yield from self._conversations(c)
        st = e.stores.stats()
        yield _gauge("kdn_edge_store_backlog_bytes", "Objects' bytes acknowledged here and not yet "
                     "durable at the origin (kdn/edge/stores.py).", value=st["backlog_bytes"])
        yield _gauge("kdn_edge_store_backlog_objects", "Objects acknowledged here and not yet durable "
                     "at the origin.", value=st["backlog_objects"])
        yield _counter("kdn_edge_tier_ops_total", "Tier operations, by tier and kind.",
                       labels=("tier", "op"), samples=[((t, op), tiers[t][op])
                                                       for t in tiers for op in TIER_OPS])
        yield _counter("kdn_edge_events_total", "Every counter of this edge, by name.",
                       labels=("event",), samples=[((k,), v) for k, v in sorted(c.items())
                                                    if k not in HIDDEN])
        if self.http is not None:
            yield from self._http()

    def _conversations(self, c):
        """The conversation tier (kdn/edge/conversations.py): bytes per tenant (an operator's
        figure: /metrics is the operator's, like the tenants' names in `kdn status`), reads,
        expiries and evictions by reason."""
        conv = self.edge.conversations.stats()
        yield _gauge("kdn_edge_conversation_bytes", "Conversation KV held, by tenant.", labels=("tenant",),
                     samples=[((t,), b) for t, b in sorted(conv["tenant_bytes"].items())])
        yield _gauge("kdn_edge_conversation_capacity_bytes", "The conversation tier's capacity.",
                     value=conv["capacity"])
        yield _gauge("kdn_edge_conversation_chunks", "Conversation chunks held.", value=conv["chunks"])
        yield _gauge("kdn_edge_conversation_tier_bytes", "Conversation KV held, by tier (memory, disk).",
                     labels=("tier",), samples=[(("memory",), conv["bytes"]), (("disk",), conv["disk_bytes"])])
        yield _counter("kdn_edge_conversation_reads_total", "Conversation chunk reads, by outcome.",
                       labels=("outcome",), samples=[(("hit",), c["conv_hits"]), (("miss",), c["conv_misses"])])
        yield _counter("kdn_edge_conversation_disk_reads_total", "Conversation chunks read back from disk.",
                       value=c["conv_disk_hits"])
        yield _counter("kdn_edge_conversation_spilled_total", "Conversation chunks moved from memory to disk.",
                       value=c["conv_spilled"])
        yield _counter("kdn_edge_conversation_kept_total", "Conversation chunks kept.", value=c["conv_kept"])
        yield _counter("kdn_edge_conversation_expired_total", "Conversation chunks idle past their TTL.",
                       value=c["conv_expired"])
        yield _counter("kdn_edge_conversation_evictions_total", "Conversation chunks evicted, by reason.",
                       labels=("reason",), samples=[(("budget",), c["conv_evicted_budget"]),
                                                    (("capacity",), c["conv_evicted_capacity"]),
                                                    (("dropped",), c["conv_dropped"])])
        yield _counter("kdn_edge_conversation_origin_chunks_total", "A pinned tenant's conversation "
                       "chunks sent to the origin (pinned) and read back from it (pulled).",
                       labels=("direction",), samples=[(("pinned",), c["conversation_pinned_chunks"]),
                                                       (("pulled",), c["conversation_pulled_chunks"])])
        yield _counter("kdn_edge_conversation_pin_failures_total", "Sends of a pinned tenant's chunks "
                       "to the origin that failed, by reason (the edge's copy stays).", labels=("reason",),
                       samples=[(("unreachable",), c["conversation_pin_failures"]),
                                (("refused",), c["conversation_pin_refused"]),
                                (("store_error",), c["conversation_pin_store_errors"])])
        yield _counter("kdn_edge_conversation_pull_waits_cut_total", "Waits for a pull-back of a "
                       "pinned tenant's chunks that ended at their deadline (the pull goes on in "
                       "the background and lands for the next turn).", value=c["conversation_pull_late"])
        yield _counter("kdn_edge_conversation_pull_failures_total", "Pull-backs of a pinned tenant's "
                       "chunks that failed with an error (logged).", value=c["conversation_pull_failures"])
        yield _counter("kdn_edge_conversation_replaced_chunks_total", "A pinned tenant's chunks "
                       "this edge held under other bytes than the origin's, replaced by the "
                       "origin's (a key keeps its first bytes).", value=c["conversation_pin_replaced"])

    def _http(self):
        h, c = self.http, self.http.counters
        yield _counter("kdn_edge_http_requests_total", "HTTP requests by endpoint and status.",
                       labels=("endpoint", "code"),
                       samples=[((ep, str(code)), n) for (ep, code), n in sorted(h.requests.items())])
        yield _counter("kdn_edge_http_bytes_sent_total", "Frame bytes sent in HTTP fetch answers.",
                       value=c["bytes_sent"])
        yield _counter("kdn_edge_http_frames_sent_total", "Frames sent in HTTP fetch answers.",
                       value=c["frames_sent"])
        yield _counter("kdn_edge_http_frames_by_codec_total", "Frames sent in HTTP fetch answers, "
                       "by codec.", labels=("codec",),
                       samples=[((k[len("frames_"):],), v) for k, v in sorted(c.items())
                                if k.startswith("frames_") and k != "frames_sent"])
        yield _counter("kdn_edge_http_fetch_aborted_total", "HTTP answers cut short by the client.",
                       value=c["aborted"])


class EdgeMetrics:
    """One edge's registry: its collector and the HTTP fetch latency histogram."""

    def __init__(self, edge, http=None):
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(EdgeCollector(edge, http))
        self.fetch_seconds = Histogram(
            "kdn_edge_http_fetch_seconds", "HTTP fetch latency: edge fetch plus sending the body.",
            buckets=LATENCY_BUCKETS, registry=self.registry)

    def exposition(self) -> bytes:
        """This edge's metrics in the Prometheus text format."""
        return generate_latest(self.registry)
