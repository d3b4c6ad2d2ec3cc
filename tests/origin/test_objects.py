"""The origin's storage backends: the same small API on a directory and on a real S3 server
(moto on loopback, credentials checked), the conditional write, and a bucket that refuses,
times out or rejects the credentials."""
import socket
import threading
import time

import pytest

from kdn.core.errors import StoreError
from kdn.origin.objects import LocalObjects, S3Objects, open_objects, parse_url


@pytest.fixture(params=["local", "s3"])
def objects(request, tmp_path):
    if request.param == "local":
        return LocalObjects(tmp_path / "objects")
    b = request.getfixturevalue("bucket")
    return open_objects(b.url, env=b.env)


def test_put_get_list_delete_on_both_backends(objects):
    assert objects.put("a/b/one", b"1" * 10) == 10
    assert objects.put("a/two", [b"2", b"22"]) == 3
    objects.put("c/three", b"3")
    assert objects.get("a/b/one") == b"1" * 10 and objects.get("a/two") == b"222"
    assert objects.head("a/b/one", 4) == b"1111" and objects.head("a/two", 100) == b"222"
    assert objects.size("a/two") == 3 and objects.size("nope") is None
    assert objects.list("a/") == [("a/b/one", 10), ("a/two", 3)]
    objects.put("a/two", b"new")                          # a put replaces the object whole
    assert objects.get("a/two") == b"new"
    with pytest.raises(FileNotFoundError):
        objects.get("nope")
    assert objects.delete("a/two") and not objects.delete("a/two")
    assert objects.list("a/") == [("a/b/one", 10)]
    assert objects.rename("c/three", "c/3") and objects.list("c/") == [("c/3", 1)]
    assert objects.set_aside("c/3", "c/3.aside") and objects.get("c/3.aside") == b"3"
    assert not objects.rename("gone", "elsewhere") and not objects.set_aside("gone", "x")
    child = objects.child("a")
    assert child.get("b/one") == b"1" * 10 and child.where("b/one") == objects.where("a/b/one")


def test_put_new_lets_exactly_one_writer_take_a_name(objects):
    """The conditional write a version commit rests on: on S3 a PUT with If-None-Match: *,
    which this server honours (412), from 8 threads at once."""
    assert objects.put_new("v/0000000001.kdnm", b"first")
    assert not objects.put_new("v/0000000001.kdnm", b"second")
    assert objects.get("v/0000000001.kdnm") == b"first"
    results, barrier = [], threading.Barrier(8)

    def go(i):
        barrier.wait()
        results.append((objects.put_new("v/0000000002.kdnm", b"w%d" % i), i))

    ts = [threading.Thread(target=go, args=(i,)) for i in range(8)]
    [t.start() for t in ts]
    [t.join() for t in ts]
    winners = [i for ok, i in results if ok]
    assert len(winners) == 1 and objects.get("v/0000000002.kdnm") == b"w%d" % winners[0]


def test_bad_locations_are_named():
    for url, why in [("s3://", "is not s3://bucket/prefix"), ("s3://a/x", "not a valid bucket name"),
                     ("s3://bucket/p?x=1", "is not s3://bucket/prefix"),
                     ("gs://bucket/p", "only a directory or s3://bucket/prefix")]:
        with pytest.raises(StoreError, match=why):
            open_objects(url)
    assert parse_url("s3://kdn-origin/a/b/") == ("kdn-origin", "a/b")


def test_wrong_credentials_and_a_missing_bucket_are_clear_errors(bucket):
    good = open_objects(bucket.url, env=bucket.env)
    good.check()
    bad = open_objects(bucket.url, env={**bucket.env, "AWS_SECRET_ACCESS_KEY": "not-the-secret"})
    with pytest.raises(StoreError, match=r"origin bucket s3://kdn-origin/t-\w+ is not usable with the "
                                         r"endpoint and credentials of AWS_ENDPOINT_URL.*403"):
        bad.check()
    with pytest.raises(StoreError, match="cannot write x.*403.*nothing was stored"):
        bad.put("x", b"1")
    assert good.size("x") is None
    missing = open_objects("s3://no-such-bucket/p", env=bucket.env)
    with pytest.raises(StoreError, match="s3://no-such-bucket/p"):
        missing.check()


def test_a_refusing_or_silent_bucket_fails_within_the_timeout():
    with socket.socket() as s:             # a port nobody listens on: connection refused
        s.bind(("127.0.0.1", 0))
        refused = s.getsockname()[1]
    silent = socket.socket()                # accepts connections (the kernel does), never answers
    silent.bind(("127.0.0.1", 0))
    silent.listen(16)
    try:
        env = {"AWS_ACCESS_KEY_ID": "k", "AWS_SECRET_ACCESS_KEY": "s", "AWS_REGION": "us-east-1"}
        for port in (refused, silent.getsockname()[1]):
            o = S3Objects("kdn-origin", "p", {**env, "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}"},
                          timeout_s=0.5, retries=1)
            t0 = time.monotonic()
            with pytest.raises(StoreError, match=rf"bucket s3://kdn-origin/p: cannot write chunk: .*"
                                                 rf"127.0.0.1:{port}.*nothing was stored"):
                o.put("chunk", b"x" * 1000)
            with pytest.raises(StoreError, match="cannot read"):
                o.size("chunk")
            assert time.monotonic() - t0 < 10
    finally:
        silent.close()
