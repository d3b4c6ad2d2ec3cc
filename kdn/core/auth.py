"""Access control: an admin token for writes and operator calls, optional per-tenant read tokens.

Publishing, deleting, operator controls and every node-to-node call (pushes, peer reads,
membership) carry the network's admin token. Tokens are compared in constant time
(hmac.compare_digest). With no admin token configured the network is open, as a single-user
development cluster; `kdn up` always configures one (kept in $KDN_HOME/admin_token, mode 0600).

Read tokens (KDN_READ_TOKENS="tenant=token,..."): with none configured, anyone reads every
tenant. Once any is configured, reading fails closed: a tenant is read with its own read token
(or the admin token), and a tenant without one, the "default" tenant a publish without
--tenant lands in included, is readable by nobody else, unless the operator leaves it open
on purpose with `tenant=*` (OPEN): then anyone reads it, with any token or none.

This sits on top of Ray's own token auth (which keeps strangers off the cluster): it keeps
one tenant's workers from reading another tenant's knowledge and readers from writing.
"""
import hmac
import os
import secrets
from dataclasses import dataclass, field
from pathlib import Path

from kdn.core.errors import AccessDenied, KDNError

OPEN = "*"          # KDN_READ_TOKENS="default=*": the operator leaves that tenant open to anyone


def _same(given, expected: str) -> bool:
    if not isinstance(given, str):
        return False
    return hmac.compare_digest(given.encode(), expected.encode())


@dataclass(frozen=True)
class Tokens:
    """The secrets a node checks: admin (writes, operators, internal) and tenant -> read token.

    readers maps a tenant to its read token, or to OPEN ("*") for a tenant the operator
    leaves open; `readers` keeps the tokens and `open` the open tenants (to_dict() gives the
    one mapping back, as `kdn up` passes it to the nodes)."""
    admin: "str | None" = None
    readers: dict = field(default_factory=dict)
    open: frozenset = frozenset()

    def __post_init__(self):
        readers = dict(self.readers or {})
        opened = frozenset(self.open or ()) | {t for t, v in readers.items() if v == OPEN}
        readers = {t: v for t, v in readers.items() if v != OPEN}
        for what, t in [("admin token", self.admin)] + [(f"read token of {k!r}", v) for k, v in readers.items()]:
            if t is not None and (not isinstance(t, str) or len(t) < 16):
                raise KDNError(f"the {what} must be a string of at least 16 characters "
                               f"(or {OPEN!r} for a read token: that tenant open to anyone)")
        both = sorted(opened & set(readers))
        if both:
            raise KDNError(f"tenant(s) {both} have a read token and are also left open ({OPEN!r}): choose one")
        object.__setattr__(self, "readers", readers)
        object.__setattr__(self, "open", opened)

    def check_admin(self, token, what: str) -> None:
        """AccessDenied unless token is the admin token; an open network (none set) lets all in."""
        if self.admin is not None and not self.is_admin(token):
            raise AccessDenied(f"{what} needs the network's admin token: missing or wrong")

    def is_admin(self, token) -> bool:
        """Whether token is the configured admin token (on an open network nobody is)."""
        return self.admin is not None and _same(token, self.admin)

    def is_open(self, tenant: str) -> bool:
        """Whether anyone may read tenant: read tokens are off, or the operator left it open."""
        return not self.readers or tenant in self.open

    def check_read(self, tenant: str, token, what: str) -> None:
        """With read tokens on, a tenant is read with its read token or the admin token,
        unless it is left open (OPEN); a tenant without a token is nobody's to read."""
        if self.is_open(tenant):
            return
        want = self.readers.get(tenant)
        if (want is not None and _same(token, want)) or self.is_admin(token):
            return
        raise AccessDenied(f"{what} of tenant {tenant!r} needs that tenant's read token: missing or wrong")

    def tenant_of_token(self, token):
        """The tenant whose read token token is (None when it is nobody's)."""
        for tenant, want in sorted(self.readers.items()):
            if _same(token, want):
                return tenant
        return None

    def to_dict(self) -> dict:
        return {"admin": self.admin, "readers": {**self.readers, **{t: OPEN for t in sorted(self.open)}}}

    @classmethod
    def from_dict(cls, d) -> "Tokens":
        d = d or {}
        return cls(d.get("admin"), dict(d.get("readers") or {}))


def read_tokens_from_env() -> dict:
    """KDN_READ_TOKENS="tenant=token,tenant2=token2" -> {tenant: token} ("tenant=*": OPEN)."""
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
        from kdn.core.env import kdn_home
        home = kdn_home()
    path = admin_token_file(home)
    return path.read_text().strip() if path.exists() else None
