"""Integrations: KDN under other systems' caches, in their own conventions.

- objects.py    another cache layer's objects in KDN: opaque byte strings under keys in a
                tenant namespace, stored through the origin and read from the nearest edge;
- lmcache.py    KDN as an LMCache L2 adapter (LMCache's multiprocess server), over objects.py;
- sglang.py     KDN as an SGLang HiCache storage backend, over objects.py.

A host's process keeps its page tables over Ray's object store filled, off the load path
(kdn.core.prefault).

Each host loads its module by path (`module_path` in its config): kdn.integrations.lmcache,
kdn.integrations.sglang. Only sglang.py imports torch at module level.
"""
