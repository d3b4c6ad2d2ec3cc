"""The launcher: a KDN network on Ray, embedded on this machine or on a real cluster.

- cluster.py  local clusters of labelled Ray nodes, starting and stopping origin and edges,
              `kdn up` / `kdn down` and the state file they share with clients.
"""
