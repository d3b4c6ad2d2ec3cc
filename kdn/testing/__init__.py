"""Real servers that tests and benchmarks start on loopback: an S3-compatible one (s3.py).

They are real servers (moto speaks S3 over HTTP), not mocks; nothing here runs in production.
"""
