"""The edge node: tiers, pull-through, forms, HTTP (see edge/node.py and docs/architecture.md)."""
