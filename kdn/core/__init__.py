"""The vocabulary every process shares: keys, chunk frames, codecs, dtypes, manifests, names,
files, auth, the transfer policy, errors, the process environment and the RPC helper.

It imports numpy, msgpack, xxhash and Ray's actor API, never torch, and nothing of the
client, the engines, the service or the launcher (tests/test_layers.py checks it), so an edge
or origin actor that only moves bytes never loads torch.
"""
