"""The origin node: durable store, membership, health, pushes (see kdn/origin/node.py and docs/architecture.md)."""
