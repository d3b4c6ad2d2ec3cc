"""Access control: an admin token for writes and operator calls, optional per-tenant read tokens.

Publishing, deleting, operator controls and every node-to-node call (pushes, peer reads,
membership) carry the network's admin token; reads of a tenant that has a read token carry
that token. Tokens are compared in constant time (hmac.compare_digest). With no admin token
configured the network is open, as a single-user development cluster; `kdn up` always
configures one (kept in $KDN_HOME/admin_token, mode 0600).

This sits on top of Ray's own token auth (which keeps strangers off the cluster): it keeps
one tenant's workers from reading another tenant's knowledge and readers from writing.
"""
import hmac
import os
import secrets
from dataclasses import dataclass, field
from pathlib import Path

from kdn.errors import AccessDenied, KDNError


def _same(given, expected: str) -> bool:
    if not isinstance(given, str):
        return False
    return hmac.compare_digest(given.encode(), expected.encode())


@dataclass(frozen=True)
class Tokens:
    """The secrets a node checks: admin (writes, operators, internal) and tenant -> read token."""
    admin: "str | None" = None
    readers: dict = field(default_factory=dict)

    def __post_init__(self):
        for what, t in [("admin token", self.admin)] + [(f"read token of {k!r}", v) for k, v in self.readers.items()]:
            if t is not None and (not isinstance(t, str) or len(t) < 16):
                raise KDNError(f"the {what} must be a string of at least 16 characters")

    def check_admin(self, token, what: str) -> None:
        """AccessDenied unless token is the admin token; an open network (none set) lets all in."""
        if self.admin is not None and not self.is_admin(token):
            raise AccessDenied(f"{what} needs the network's admin token: missing or wrong")

    def is_admin(self, token) -> bool:
        """Whether token is the configured admin token (on an open network nobody is)."""
        return self.admin is not None and _same(token, self.admin)

    def check_read(self, tenant: str, token, what: str) -> None:
        """A tenant with a read token needs it (or the admin token); others read freely."""
        want = self.readers.get(tenant)
        if want is None:
            return
        if _same(token, want) or (self.admin is not None and _same(token, self.admin)):
            return
        raise AccessDenied(f"{what} of tenant {tenant!r} needs that tenant's read token: missing or wrong")

    def to_dict(self) -> dict:
        return {"admin": self.admin, "readers": dict(self.readers)}

    @classmethod
    def from_dict(cls, d) -> "Tokens":
        d = d or {}
        return cls(d.get("admin"), dict(d.get("readers") or {}))


def read_tokens_from_env() -> dict:
    """KDN_READ_TOKENS="tenant=token,tenant2=token2" -> {tenant: token}."""
    out = {}
    for part in filter(None, (os.environ.get("KDN_READ_TOKENS") or "").split(",")):
        tenant, sep, token = part.partition("=")
        if not sep or not tenant.strip() or not token.strip():
            raise KDNError(f"KDN_READ_TOKENS entries must be tenant=token, got {part!r}")
        out[tenant.strip()] = token.strip()
    return out


def admin_token_file(home: Path) -> Path:
    return Path(home) / "admin_token"


def ensure_admin_token(home: Path) -> str:
    """$KDN_ADMIN_TOKEN, else the token in home/admin_token (created 0600 when missing)."""
    env = os.environ.get("KDN_ADMIN_TOKEN")
    if env:
        return env
    path = admin_token_file(home)
    if path.exists():
        return path.read_text().strip()
    path.parent.mkdir(parents=True, exist_ok=True)
    token = secrets.token_urlsafe(32)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(token)
    return token


def load_admin_token(home: Path = None):
    """The admin token of the network `kdn up` started on this machine, for the CLI and for
    operators' Python: $KDN_ADMIN_TOKEN, else the file in home (default $KDN_HOME), else None."""
    env = os.environ.get("KDN_ADMIN_TOKEN")
    if env:
        return env
    if home is None:
        from kdn.env import kdn_home
        home = kdn_home()
    path = admin_token_file(home)
    return path.read_text().strip() if path.exists() else None
