"""The origin node: durable store, membership, health, pushes (see origin/node.py and docs/architecture.md)."""
