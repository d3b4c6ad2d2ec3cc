"""The edge node: tiers, pull-through, forms, HTTP (see kdn/edge/node.py and docs/architecture.md)."""
