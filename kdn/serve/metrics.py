"""`kdn serve`'s counters for `/metrics` (Prometheus text) and `kdn status`, summed over the ingress.

Each ingress replica (kdn.serve.app.Ingress) counts its requests, errors and region decisions,
and its request routers (kdn.serve.router, one per region) count their replica decisions. A
scrape reaches one ingress replica, chosen by Serve, so each replica writes its snapshot to
Ray's GCS key-value store (the store Serve keeps its own state in) under the service's
prefix, every PUBLISH_PERIOD_S and at each scrape, and `/metrics` and `kdn status` read and
sum every replica's: any scrape sees the whole service, at most PUBLISH_PERIOD_S behind for
the other replicas. Where answers' KV came from is counted by the region's replicas, which
every ingress replica hears of: those counts are merged per region replica (the largest
count any ingress replica heard: each only grows), then summed. A replica that died keeps its entry (its decisions happened), so every
sum only grows, as a Prometheus counter must; `kdn serve --down` deletes the entries.
The exposition is prometheus_client's, as the edge's (kdn/edge/metrics.py): a collector over the
snapshot in a registry of its own. No counter names a tenant or a KB.
"""
import collections
import json

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, SummaryMetricFamily

from kdn.serve.regions import KV_SOURCES, OUTCOMES, TIERS

PUBLISH_PERIOD_S = 1.0
KV_NAMESPACE = "kdn-serve"
REPLICA_OUTCOMES = ("engine_hit", "routed_away_queue", "owner", "owner_busy")
REGION_OUTCOMES = OUTCOMES + ("pinned", "conversation")   # conversation: where its history is (kdn.serve.affinity)


def _prefix(network: str) -> str:
    return f"{network}/ingress/"


def publish(network: str, replica: str, snapshot: dict) -> None:
    """Write one ingress replica's snapshot ({"counters", "routing": {region: counters},
    "kv_sources": {region: {region replica: {source: answers}}}})."""
    from ray.experimental.internal_kv import _internal_kv_put
    _internal_kv_put(_prefix(network) + replica, json.dumps(snapshot), namespace=KV_NAMESPACE)


def gather(network: str) -> dict:
    """Every ingress replica's snapshot summed: {"counters", "routing", "kv_sources": {region:
    {source: answers}}, "replicas"} ({} when no replica ever wrote one)."""
    from ray.experimental.internal_kv import _internal_kv_get, _internal_kv_list
    snaps = []
    for k in _internal_kv_list(_prefix(network), namespace=KV_NAMESPACE):
        raw = _internal_kv_get(k, namespace=KV_NAMESPACE)
        if raw is not None:          # (None: deleted between the list and the get)
            snaps.append(json.loads(raw))
    return merged(snaps)


def merged(snaps) -> dict:
    """Ingress replicas' snapshots as one (gather()): their counters summed, the region
    replicas' KV sources merged per region replica (largest count heard), then summed."""
    counters, routing, n = collections.Counter(), collections.defaultdict(collections.Counter), 0
    heard = collections.defaultdict(dict)        # (region, region replica) -> {source: largest count}
    for snap in snaps:
        counters.update(snap.get("counters", {}))
        for region, c in snap.get("routing", {}).items():
            routing[region].update(c)
        for region, replicas in snap.get("kv_sources", {}).items():
            for replica, c in replicas.items():
                mine = heard[(region, replica)]
                for source, v in c.items():
                    mine[source] = max(mine.get(source, 0), v)
        n += 1
    if not n:
        return {}
    sources = collections.defaultdict(collections.Counter)
    for (region, _), c in heard.items():
        sources[region].update(c)
    return {"counters": dict(counters), "routing": {r: dict(c) for r, c in routing.items()},
            "kv_sources": {r: dict(c) for r, c in sources.items()}, "replicas": n}


def forget(network: str) -> None:
    """Delete the service's snapshots (when it is stopped)."""
    from ray.experimental.internal_kv import _internal_kv_del
    _internal_kv_del(_prefix(network), del_by_prefix=True, namespace=KV_NAMESPACE)


def _family(kind, name, doc, labels, samples):
    m = kind(name, doc, labels=labels)
    for label_values, v in samples:
        m.add_metric(label_values, v)
    return m


class ServiceCollector:
    """Metric families of one service snapshot (gather())."""

    def __init__(self, snapshot: dict):
        self.snap = snapshot

    def collect(self):
        c = collections.Counter(self.snap.get("counters", {}))
        routing = self.snap.get("routing", {})
        regions = sorted({k[len("region_"):] for k in c if k.startswith("region_")} | set(routing))
        yield GaugeMetricFamily("kdn_serve_ingress_replicas", "Ingress replicas that reported "
                                "(every one ever started: counters are kept across their deaths).",
                                value=self.snap.get("replicas", 0))
        yield CounterMetricFamily("kdn_serve_requests_total", "HTTP requests the ingress received.",
                                  value=c["requests"])
        yield _family(CounterMetricFamily, "kdn_serve_region_requests_total",
                      "Requests sent to a region's deployment.", ["region"],
                      [((r,), c[f"region_{r}"]) for r in regions])
        yield _family(CounterMetricFamily, "kdn_serve_region_decisions_total",
                      "Which region answers: home, routed across regions (for the queue or for "
                      "where the KV is), home had no replica, nothing known yet, or named in the path.",
                      ["outcome"], [((o,), c[f"route_{o}"]) for o in REGION_OUTCOMES])
        yield _family(CounterMetricFamily, "kdn_serve_region_tier_total",
                      "Region decisions by the tier expected to hold the KB's KV where the request went.",
                      ["tier"], [((t,), c[f"tier_{t}"]) for t in TIERS])
        s = SummaryMetricFamily("kdn_serve_region_decision_seconds", "Time the region decision took.",
                                count_value=c["route_decisions"], sum_value=c["route_decision_us"] / 1e6)
        yield s
        yield _family(CounterMetricFamily, "kdn_serve_replica_decisions_total",
                      "Which replica of a region answers: its engine holds the KB, routed away for "
                      "the queue, the KB's rendezvous owner, or the owner was busy.",
                      ["region", "outcome"],
                      [((r, o), routing[r].get(o, 0)) for r in sorted(routing) for o in REPLICA_OUTCOMES])
        rs = SummaryMetricFamily("kdn_serve_replica_decision_seconds", "Time the replica decision took.",
                                 labels=["region"])
        for r in sorted(routing):
            rs.add_metric((r,), routing[r].get("decisions", 0), routing[r].get("decision_us", 0) / 1e6)
        yield rs
        yield _family(CounterMetricFamily, "kdn_serve_replica_rechosen_total",
                      "Times Serve asked a region's router again for a request it had decided, "
                      "the replicas it was given being full.", ["region"],
                      [((r,), routing[r].get("rechosen", 0)) for r in sorted(routing)])
        yield _family(CounterMetricFamily, "kdn_serve_replicas_died_total",
                      "Replicas a region's router saw die.", ["region"],
                      [((r,), routing[r].get("replicas_died", 0)) for r in sorted(routing)])
        sources = self.snap.get("kv_sources", {})
        yield _family(CounterMetricFamily, "kdn_serve_kv_source_total",
                      "Answers over a KB's exact KV by where that KV came from, as the replica "
                      "that answered measured it: its engine's cache, the region's edge (memory "
                      "or disk tier), a peer edge, the origin (the farthest any chunk came "
                      "from), or none (computed).", ["region", "source"],
                      [((r, s), sources[r].get(s, 0)) for r in sorted(sources) for s in KV_SOURCES])
        yield _family(CounterMetricFamily, "kdn_serve_errors_total", "Error answers, by HTTP status.",
                      ["code"], [((k[len("errors_"):],), v) for k, v in sorted(c.items())
                                 if k.startswith("errors_")])
        yield CounterMetricFamily("kdn_serve_retries_total", "Requests sent once more because their "
                                  "replica died before answering.", value=c["retried_replica_died"])
        yield CounterMetricFamily("kdn_serve_broken_streams_total", "Streams ended by an error event "
                                  "(their replica failed mid-answer).", value=c["broken_streams"])
        yield _family(CounterMetricFamily, "kdn_serve_events_total", "Every counter of the ingress, by name.",
                      ["event"], [((k,), v) for k, v in sorted(c.items())])


def exposition(snapshot: dict) -> bytes:
    """A service snapshot in the Prometheus text format."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(ServiceCollector(snapshot))
    return generate_latest(registry)


def summary_lines(snapshot: dict) -> list:
    """What `kdn status` prints of the service's routing (snapshot: gather())."""
    if not snapshot:
        return ["  routing: no decisions yet"]
    c, routing = snapshot["counters"], snapshot["routing"]
    n = c.get("route_decisions", 0)
    regions = ", ".join(f"{o.replace('_', ' ')} {c[f'route_{o}']}" for o in REGION_OUTCOMES if c.get(f"route_{o}"))
    tiers = ", ".join(f"{t.replace('_', ' ')} {c[f'tier_{t}']}" for t in TIERS if c.get(f"tier_{t}"))
    us = c.get("route_decision_us", 0) / max(1, n)
    lines = [f"  regions: {n} decisions ({us:.0f} us mean): {regions or 'none'}",
             f"  KV expected in: {tiers or 'none yet'}"]
    sources = snapshot.get("kv_sources", {})
    for r in sorted(set(routing) | set(sources)):
        d = routing.get(r, {})
        outcomes = ", ".join(f"{o.replace('_', ' ')} {d[o]}" for o in REPLICA_OUTCOMES if d.get(o))
        kv = sources.get(r, {})
        got = ", ".join(f"{s.replace('_', ' ')} {kv[s]}" for s in KV_SOURCES if kv.get(s))
        lines.append(f"  {r} replicas: {d.get('decisions', 0)} decisions "
                     f"({d.get('decision_us', 0) / max(1, d.get('decisions', 0)):.0f} us mean): {outcomes or 'none'}"
                     + (f"; asked again {d['rechosen']} times (replicas full)" if d.get("rechosen") else "")
                     + (f", {d['replicas_died']} replicas died" if d.get("replicas_died") else ""))
        lines.append(f"  {r} answers' KV from: {got or 'none yet'}")
    lines.append(f"  ingress: {c.get('requests', 0)} requests, {c.get('retried_replica_died', 0)} retried "
                 f"(replica died), {c.get('broken_streams', 0)} broken streams, over {snapshot['replicas']} replicas")
    return lines
