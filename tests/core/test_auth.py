"""Tokens (kdn/core/auth.py): the admin token for writes, per-tenant read tokens, files 0600.
Reads across tenants on a live network are in tests/multinode/test_auth.py."""
import os
import stat

import pytest

from kdn.core.auth import Tokens, ensure_admin_token, load_admin_token, read_tokens_from_env
from kdn.core.errors import AccessDenied, KDNError

ADMIN, ACME = "admin-0123456789abcdef", "acme-0123456789abcdef"


def test_admin_and_read_checks():
    t = Tokens(ADMIN, {"acme": ACME})
    t.check_admin(ADMIN, "publish")
    assert t.is_admin(ADMIN) and not t.is_admin(ACME) and not t.is_admin(None)
    with pytest.raises(AccessDenied, match="publish needs the network's admin token"):
        t.check_admin(ACME, "publish")
    t.check_read("acme", ACME, "fetch")
    t.check_read("acme", ADMIN, "fetch")             # the admin reads every tenant
    with pytest.raises(AccessDenied, match="tenant 'acme' needs that tenant's read token"):
        t.check_read("acme", "wrong-token-0123456789", "fetch")


def test_with_read_tokens_on_a_tenant_without_one_is_closed_unless_left_open():
    """Read tokens fail closed: "default" (where a publish without --tenant lands) and any
    other tenant without a read token are read with the admin token only, unless the
    operator leaves them open with tenant=*."""
    t = Tokens(ADMIN, {"acme": ACME})
    for tenant in ("default", "other"):
        for token in (None, "any-token-0123456789", ACME):
            with pytest.raises(AccessDenied, match=f"tenant '{tenant}' needs that tenant's read token"):
                t.check_read(tenant, token, "fetch")
        t.check_read(tenant, ADMIN, "fetch")
    left_open = Tokens.from_dict({"admin": ADMIN, "readers": {"acme": ACME, "default": "*"}})
    assert left_open.readers == {"acme": ACME} and left_open.open == {"default"}
    for token in (None, "any-token-0123456789"):
        left_open.check_read("default", token, "fetch")
    with pytest.raises(AccessDenied):
        left_open.check_read("other", None, "fetch")
    assert left_open.to_dict() == {"admin": ADMIN, "readers": {"acme": ACME, "default": "*"}}
    assert Tokens.from_dict(left_open.to_dict()) == left_open
    assert left_open.tenant_of_token("*") is None and left_open.tenant_of_token(ACME) == "acme"
    Tokens(ADMIN, {}).check_read("anyone", None, "fetch")      # read tokens off: all open


def test_an_open_network_has_no_admin():
    t = Tokens()
    t.check_admin(None, "publish")
    assert not t.is_admin(None) and not t.is_admin(ADMIN)


def test_short_tokens_and_bad_env_are_refused(monkeypatch):
    with pytest.raises(KDNError, match="at least 16 characters"):
        Tokens("short")
    monkeypatch.setenv("KDN_READ_TOKENS", f"acme={ACME}, b = {ACME}, default=*")
    assert read_tokens_from_env() == {"acme": ACME, "b": ACME, "default": "*"}
    assert Tokens(ADMIN, read_tokens_from_env()).open == {"default"}
    monkeypatch.setenv("KDN_READ_TOKENS", "acme")
    with pytest.raises(KDNError, match="tenant=token"):
        read_tokens_from_env()


def test_the_admin_token_file_is_made_once_and_private(tmp_path, monkeypatch):
    monkeypatch.delenv("KDN_ADMIN_TOKEN", raising=False)
    monkeypatch.setenv("KDN_HOME", str(tmp_path))
    assert load_admin_token() is None
    token = ensure_admin_token(tmp_path)
    assert ensure_admin_token(tmp_path) == token == load_admin_token() == load_admin_token(tmp_path)
    assert stat.S_IMODE(os.stat(tmp_path / "admin_token").st_mode) == 0o600
    monkeypatch.setenv("KDN_ADMIN_TOKEN", ADMIN)
    assert load_admin_token() == ADMIN
