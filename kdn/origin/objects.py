"""Where the origin's bytes live: a small object-storage API over a local folder or an S3 bucket.

The origin's store, manifests and membership need only six things of their storage: put an
object whole (readers see the old bytes or the new, never a torn write), put one only if its
name is still free (the one conditional write, which is what makes a version number taken
by exactly one publisher), get, list a prefix, delete, and set an object aside under another
name. `LocalObjects` does them on a directory (kdn.core.files: temp file, fsync, rename; a
create-if-absent is a hard link, which fails if the name exists). `S3Objects` does them on
an S3-compatible bucket through obstore: maintained Python bindings of the Rust crate
`object_store` (Apache Arrow's), chosen for throughput (each request runs in Rust with the GIL released, so
the origin's reads and writes in threads overlap; bytes go in and come out without Python
parsing XML or copying in chunks) and because it exposes the conditional PUT. Its
create-if-absent is a PUT with `If-None-Match: *`, which S3 (since 2024), MinIO and moto
honour (moto answers 412: tested). Nothing of the origin lives outside these objects, so
over a bucket the origin can restart on any node.

Every failure of the storage itself is a StoreError naming the location and the operation
(a refused or timed-out bucket, wrong credentials); a missing object is FileNotFoundError.
"""
import datetime
import os
import re
from pathlib import Path
from urllib.parse import urlparse

from kdn.core.errors import StoreError
from kdn.core.files import DIR_MODE, DIRECT_MIN_BYTES, TEMP_SUFFIX, fsync_dir, make_dirs, write_atomic, write_temp

S3_ENV = ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_REGION",
          "AWS_SESSION_TOKEN")
BUCKET_TIMEOUT_S = 30.0  # one request to the bucket; a hung bucket fails a publish, never stalls it
RETRIES = 2             # retries of a failed request (obstore's default is 10, over up to 3 min)
CORRUPT_SUFFIX = ".corrupt"   # an object that failed its check is set aside under name + this


def is_bucket(location) -> bool:
    return isinstance(location, str) and location.startswith("s3://")


def open_objects(location, fsync: bool = True, env: dict = None, timeout_s: float = BUCKET_TIMEOUT_S,
                 retries: int = RETRIES):
    """LocalObjects for a path, S3Objects for s3://bucket/prefix (endpoint and credentials from
    env, default the process's AWS_* variables); an Objects passes through."""
    if isinstance(location, (LocalObjects, S3Objects)):
        return location
    if is_bucket(location):
        return S3Objects.from_url(location, env=env, timeout_s=timeout_s, retries=retries)
    if isinstance(location, str) and "://" in location:
        raise StoreError(f"origin location {location!r}: only a directory or s3://bucket/prefix "
                         f"is supported")
    return LocalObjects(location, fsync=fsync)


class LocalObjects:
    """Objects as files under root; an object's name is its path relative to root."""

    def __init__(self, root, fsync: bool = True):
        self.root = make_dirs(root)
        os.chmod(self.root, DIR_MODE)    # a store made before files were private: close it now
        self.fsync = fsync

    def child(self, sub: str) -> "LocalObjects":
        return LocalObjects(self.root / sub, fsync=self.fsync)

    def where(self, name: str = "") -> str:
        return str(self.root / name) if name else str(self.root)

    def path(self, name: str) -> Path:
        return self.root / name

    def _failed(self, op: str, name: str, e: OSError) -> StoreError:
        return StoreError(f"cannot {op} {name} under {self.root}: {e.strerror or e} "
                          f"(errno {e.errno}); nothing was stored")

    def put(self, name: str, parts, durable: bool = True) -> int:
        """Write the object whole (atomic; durable unless durable=False, when sync() must
        follow before anyone is told it is stored); returns its size. One of
        DIRECT_MIN_BYTES or more, in a store that fsyncs, goes around the page cache
        (kdn.core.files: O_DIRECT where the file system takes it)."""
        if isinstance(parts, (bytes, bytearray, memoryview)):
            parts = [parts]
        direct = self.fsync and isinstance(parts, (list, tuple)) and \
            sum(memoryview(p).nbytes for p in parts) >= DIRECT_MIN_BYTES
        try:
            return write_atomic(self.root / name, parts, self.fsync and durable, direct)
        except OSError as e:    # disk full, quota, I/O error: kdn.core.files left nothing behind
            raise self._failed("write", Path(name).name, e) from None

    def sync(self, names, each=map) -> None:
        """Make objects put with durable=False durable: each file fsynced (each= runs them
        several at once), then each folder holding them once, instead of a file and a folder
        per object."""
        if not self.fsync:
            return
        names = list(names)

        def one(path):
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        try:
            list(each(one, [self.root / n for n in names]))
            list(each(one, sorted({(self.root / n).parent for n in names})))
        except OSError as e:
            raise StoreError(f"cannot fsync {len(names)} objects under {self.root}: "
                             f"{e.strerror or e} (errno {e.errno}); they are not durable") from None

    def modified(self, name: str):
        """When the object was last written (seconds since the epoch), None if absent."""
        try:
            return (self.root / name).stat().st_mtime
        except FileNotFoundError:
            return None

    def put_new(self, name: str, data) -> bool:
        """Write the object only if the name is free (False, nothing written, if it is not)."""
        path = self.root / name
        try:
            tmp, _ = write_temp(path, [data], self.fsync)
            try:
                os.link(tmp, path)             # atomic, and fails if path exists
            except FileExistsError:
                return False
            finally:
                tmp.unlink()
            if self.fsync:
                fsync_dir(path.parent)
        except OSError as e:
            raise self._failed("write", path.name, e) from None
        return True

    def get(self, name: str) -> bytes:
        with open(self.root / name, "rb") as f:
            return f.read()

    def head(self, name: str, n: int) -> bytes:
        """The object's first n bytes (fewer if it is shorter)."""
        with open(self.root / name, "rb") as f:
            return f.read(n)

    def size(self, name: str):
        """The object's size, None if absent."""
        try:
            return (self.root / name).stat().st_size
        except FileNotFoundError:
            return None

    def list(self, prefix: str) -> list:
        """[(name, size)] of every object whose name starts with prefix (a folder, ending in
        "/"), sorted by name; temp files of unfinished writes are not objects."""
        base = self.root / prefix
        out = []
        for dirpath, _, files in os.walk(base):
            for f in files:
                if f.endswith(TEMP_SUFFIX):
                    continue
                p = Path(dirpath) / f
                try:
                    out.append((str(p.relative_to(self.root)), p.stat().st_size))
                except FileNotFoundError:    # deleted meanwhile
                    continue
        return sorted(out)

    def delete(self, name: str) -> bool:
        try:
            (self.root / name).unlink()
            return True
        except FileNotFoundError:
            return False

    def rename(self, name: str, new: str) -> bool:
        """Move the object to a new name (False if it was gone)."""
        try:
            os.replace(self.root / name, self.root / new)
        except FileNotFoundError:
            return False
        if self.fsync:
            fsync_dir((self.root / new).parent)
        return True

    def set_aside(self, name: str, aside: str) -> bool:
        """Take the object out of the way under another name (a rename here)."""
        return self.rename(name, aside)

    def clean_partials(self) -> int:
        """Delete temp files a crashed writer left behind; return how many."""
        n = 0
        for dirpath, _, files in os.walk(self.root):
            for f in files:
                if f.endswith(TEMP_SUFFIX):
                    os.unlink(os.path.join(dirpath, f))
                    n += 1
        return n


def s3_settings(env: dict = None) -> dict:
    """The AWS_* variables that say how to reach a bucket, from env (default os.environ)."""
    env = os.environ if env is None else env
    return {k: env[k] for k in S3_ENV if env.get(k)}


def parse_url(url: str) -> tuple:
    """(bucket, prefix) of s3://bucket/prefix, or StoreError naming what is wrong."""
    u = urlparse(url)
    bucket, prefix = u.netloc, u.path.strip("/")
    if u.scheme != "s3" or not bucket or u.query or u.fragment:
        raise StoreError(f"origin location {url!r} is not s3://bucket/prefix")
    if not 3 <= len(bucket) <= 63 or not all(c.isalnum() or c in "-." for c in bucket):
        raise StoreError(f"origin location {url!r}: {bucket!r} is not a valid bucket name")
    return bucket, prefix


_CODES = {"SignatureDoesNotMatch": "the secret access key is wrong",
          "InvalidAccessKeyId": "the access key id is unknown",
          "AccessDenied": "these credentials may not use this bucket",
          "NoSuchBucket": "the bucket does not exist"}


def _short(e) -> str:
    """What went wrong first (an S3 error code in words, no answer, a refused connection),
    then obstore's message without its multi-line debug dump."""
    text = " ".join(str(e).split("\n\nDebug source:")[0].split())
    code = re.search(r"<Code>(\w+)</Code>", text)
    if code:
        why = f"{code.group(1)}: {_CODES.get(code.group(1), 'refused by the server')}"
    elif "error sending request" in text or "timed out" in text:
        why = "nothing answers at the endpoint (connection refused or timed out)"
    else:
        why = "failed"
    text = text if len(text) <= 400 else text[:400] + "..."
    return f"{why} ({text})"


class S3Objects:
    """Objects in an S3-compatible bucket under a prefix, through obstore."""

    def __init__(self, bucket: str, prefix: str = "", settings: dict = None,
                 timeout_s: float = BUCKET_TIMEOUT_S, retries: int = RETRIES):
        from obstore.store import S3Store
        self.bucket, self.prefix = bucket, prefix.strip("/")
        self.settings = dict(settings or {})
        self.timeout_s, self.retries = timeout_s, retries
        s = self.settings
        endpoint = s.get("AWS_ENDPOINT_URL")
        kw = dict(region=s.get("AWS_REGION", "us-east-1"))
        if endpoint:
            kw["endpoint"] = endpoint
        if s.get("AWS_ACCESS_KEY_ID"):
            kw.update(access_key_id=s["AWS_ACCESS_KEY_ID"],
                      secret_access_key=s.get("AWS_SECRET_ACCESS_KEY", ""))
        if s.get("AWS_SESSION_TOKEN"):
            kw["session_token"] = s["AWS_SESSION_TOKEN"]
        self._store = S3Store(
            bucket, prefix=self.prefix or None,
            client_options=dict(allow_http=bool(endpoint and endpoint.startswith("http://")),
                                timeout=f"{int(timeout_s * 1000)}ms",
                                connect_timeout=f"{int(min(timeout_s, 5.0) * 1000)}ms"),
            retry_config=dict(max_retries=retries,
                              backoff=dict(init_backoff=datetime.timedelta(milliseconds=50),
                                           max_backoff=datetime.timedelta(seconds=2), base=2),
                              retry_timeout=datetime.timedelta(seconds=timeout_s * (retries + 1))),
            **kw)

    @classmethod
    def from_url(cls, url: str, env: dict = None, **kw) -> "S3Objects":
        bucket, prefix = parse_url(url)
        return cls(bucket, prefix, s3_settings(env), **kw)

    def child(self, sub: str) -> "S3Objects":
        return S3Objects(self.bucket, f"{self.prefix}/{sub}".strip("/"), self.settings,
                         self.timeout_s, self.retries)

    def where(self, name: str = "") -> str:
        return "s3://" + "/".join(p for p in (self.bucket, self.prefix, name) if p)

    def _failed(self, op: str, name: str, e) -> StoreError:
        return StoreError(f"bucket {self.where()}: cannot {op} {name or 'its objects'}: {_short(e)}"
                          + ("; nothing was stored" if op == "write" else ""))

    def check(self) -> None:
        """Reach the bucket and list one object: StoreError if it is unreachable, missing or
        the credentials are refused (what `kdn up` checks before it starts anything)."""
        import obstore
        try:
            next(iter(obstore.list(self._store, chunk_size=1)), None)   # under the prefix
        except obstore.exceptions.BaseError as e:
            raise StoreError(f"origin bucket {self.where()} is not usable with the endpoint and "
                             f"credentials of AWS_ENDPOINT_URL / AWS_ACCESS_KEY_ID / "
                             f"AWS_SECRET_ACCESS_KEY / AWS_REGION: {_short(e)}") from None
        except FileNotFoundError as e:
            raise StoreError(f"origin bucket {self.where()} does not exist: {_short(e)}") from None

    def put(self, name: str, parts, durable: bool = True) -> int:
        """Write the object whole (a PUT is durable when it answers, whatever durable says)."""
        import obstore
        if not isinstance(parts, (bytes, bytearray, memoryview)):
            parts = list(parts)
            data = parts[0] if len(parts) == 1 else b"".join(parts)   # one frame: no copy
        else:
            data = parts
        try:
            obstore.put(self._store, name, data, use_multipart=False)
        except obstore.exceptions.BaseError as e:
            raise self._failed("write", name, e) from None
        return len(data)

    def sync(self, names, each=map) -> None:
        """Nothing to do: every PUT was durable when it answered."""

    def modified(self, name: str):
        """When the object was last written (seconds since the epoch), None if absent."""
        import obstore
        try:
            return obstore.head(self._store, name)["last_modified"].timestamp()
        except FileNotFoundError:
            return None
        except obstore.exceptions.BaseError as e:
            raise self._failed("read", name, e) from None

    def put_new(self, name: str, data) -> bool:
        import obstore
        try:
            obstore.put(self._store, name, data, mode="create", use_multipart=False)
        except (obstore.exceptions.AlreadyExistsError, obstore.exceptions.PreconditionError):
            return False
        except obstore.exceptions.BaseError as e:
            raise self._failed("write", name, e) from None
        return True

    def get(self, name: str) -> bytes:
        import obstore
        try:
            return bytes(obstore.get(self._store, name).bytes())
        except obstore.exceptions.BaseError as e:
            raise self._failed("read", name, e) from None

    def head(self, name: str, n: int) -> bytes:
        import obstore
        try:
            size = obstore.head(self._store, name)["size"]
            return bytes(obstore.get_range(self._store, name, start=0, length=min(n, size)))
        except obstore.exceptions.BaseError as e:
            raise self._failed("read", name, e) from None

    def size(self, name: str):
        import obstore
        try:
            return obstore.head(self._store, name)["size"]
        except FileNotFoundError:
            return None
        except obstore.exceptions.BaseError as e:
            raise self._failed("read", name, e) from None

    def list(self, prefix: str) -> list:
        import obstore
        out = []
        try:
            for batch in obstore.list(self._store, prefix=prefix or None):
                out.extend((m["path"], m["size"]) for m in batch)
        except obstore.exceptions.BaseError as e:
            raise self._failed("list", prefix, e) from None
        return sorted(out)

    def delete(self, name: str) -> bool:
        import obstore
        if self.size(name) is None:
            return False
        try:
            obstore.delete(self._store, name)
        except FileNotFoundError:
            return False
        except obstore.exceptions.BaseError as e:
            raise self._failed("delete", name, e) from None
        return True

    def _copy(self, name: str, new: str) -> bool:
        import obstore
        try:
            obstore.copy(self._store, name, new)
        except FileNotFoundError:
            return False
        except obstore.exceptions.BaseError as e:
            raise self._failed("copy", name, e) from None
        return True

    def rename(self, name: str, new: str) -> bool:
        """Copy, then delete (a bucket has no rename): a crash between leaves both."""
        return self._copy(name, new) and (self.delete(name) or True)

    def set_aside(self, name: str, aside: str) -> bool:
        """Copy the object to aside and keep it: its name stays taken, so a conditional write
        can never reuse it (a deleted version's number must never come back)."""
        return self._copy(name, aside)

    def clean_partials(self) -> int:
        return 0        # a PUT is whole or absent: a bucket has no partial objects
