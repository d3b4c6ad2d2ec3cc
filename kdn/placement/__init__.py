"""Placement: which edges hold a chunk, how far each source is, and where hot copies go.

The ring (`ring.Ring`) ranks every edge for every key by weighted rendezvous hashing, so
`owners(key, r)` is r distinct edges, spread across regions, the same in every process,
and a join or a leave moves only the keys that must move; `assign_bounded` caps any edge
at c times its share when the request mix is skewed. The topology (`topology.Topology`)
knows regions, links and edge capacities, and ranks sources by the time a transfer would
take. The replication policy (`replication.ReplicationPolicy`) turns the demand each
region shows into hot copies there, within a byte budget and with operator overrides.
`sim` replays a multi-region trace against placement policies (reported by `kdn bench
placement`). Pure Python and numpy:
no Ray, no torch, nothing from kdn but its vocabulary (kdn.core: errors and checks).
"""
from kdn.placement.replication import Decision, Override, ReplicationPolicy
from kdn.placement.ring import Edge, Ring, key_hashes
from kdn.placement.topology import Topology

__all__ = ["Edge", "Ring", "key_hashes", "Topology", "ReplicationPolicy", "Decision", "Override"]
