"""Testing tools: real servers that tests and benchmarks start on loopback (s3.py: an
S3-compatible one), and the HTTP fuzzer (fuzzer.py) that `kdn bench fuzz` and the tests run
against a live edge.

The servers are real (moto speaks S3 over HTTP), not mocks; nothing here runs in production.
"""
