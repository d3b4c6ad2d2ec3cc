"""Every error KDN raises on purpose is a KDNError: one base, one subclass per problem.

A caller can catch `KDNError` to handle anything KDN refuses, or a subclass to handle one
problem. Messages say what is wrong and with which value, so a log line is enough to act.
"""


class KDNError(Exception):
    """Base of every error KDN raises on purpose."""


# --- chunk frames (kdn/core/chunk.py) -------------------------------------------------------
class FrameError(KDNError):
    """A chunk frame cannot be decoded."""


class TruncatedFrame(FrameError):
    """The frame ends before its header or payload does."""


class BadLength(FrameError):
    """A declared length disagrees with the bytes or with the declared shape."""


class UnknownVersion(FrameError):
    """The frame's format version is not one this build reads."""


class UnknownDtype(FrameError):
    """The frame declares a dtype KDN does not know."""


class UnknownCodec(FrameError):
    """The frame declares a codec KDN does not know."""


class SizeLimitExceeded(FrameError):
    """A declared size is beyond what KDN accepts (absurd or hostile input)."""


class ChecksumMismatch(FrameError):
    """The payload's checksum differs from the one in the header: the bytes are corrupt."""


class BadHeader(FrameError):
    """The header is not valid msgpack, or lacks or mistypes a field."""


# --- keys ------------------------------------------------------------------------------
class BadTokens(KDNError):
    """Token ids that cannot be hashed: not integers, negative, or too large."""


# --- origin store / manifests ----------------------------------------------------------
class StoreError(KDNError):
    """The durable store refused or failed an operation."""


class ChunkNotFound(StoreError, KeyError):
    """No chunk with this key is stored."""

    def __str__(self):  # KeyError would quote the message
        return Exception.__str__(self)


class CorruptChunk(StoreError):
    """A stored chunk failed verification: never served."""


class ManifestError(KDNError):
    """A knowledge-base manifest is malformed or inconsistent."""


class VersionNotFound(StoreError, KeyError):
    """No committed version of this knowledge base exists."""

    def __str__(self):
        return Exception.__str__(self)


# --- edge cache ------------------------------------------------------------------------
class CacheError(KDNError):
    """The edge cache refused an operation."""


class PinCapacityError(CacheError):
    """Pinning this chunk would exceed the cache's byte capacity."""


# --- placement -------------------------------------------------------------------------
class PlacementError(KDNError):
    """The ring or replication policy cannot do what was asked."""


class TopologyError(PlacementError):
    """A topology file or object is invalid."""


# --- network ---------------------------------------------------------------------------
class NetworkError(KDNError):
    """The KDN network cannot be reached or answered wrongly."""


class NoLiveEdge(NetworkError):
    """Every edge the client tried failed or timed out."""


class RemoteError(KDNError):
    """A node answered, with a fault of its own: an HTTP 5xx, or a reply that breaks the
    protocol (a chunk not asked for, a malformed body). Surfaced to the caller, never failed
    over as if the node were down (kdn.core.rpc.Unreachable is that: no answer at all)."""


class AccessDenied(KDNError):
    """A missing or wrong token, or a read across tenants."""


class BadRequest(KDNError):
    """A request is malformed or beyond limits."""


class ModelError(KDNError):
    """A model cannot be loaded, or KV does not fit it."""


class BadKey(BadRequest, TypeError):
    """A key handed to an integration is not what its interface takes (SGLang's HiCache: a
    non-empty str); a TypeError too, which is what the host's own backends raise for one."""


class BadConfig(BadRequest, ValueError):
    """An integration's settings (LMCache adapter_params, SGLang's extra config) are wrong;
    the message names the field. A ValueError too, which is what those hosts' config
    loaders catch and report."""
