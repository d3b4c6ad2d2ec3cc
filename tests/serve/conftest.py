"""Fixtures of the service's tests: `kdn_cli`, the `kdn` command run in this process."""
import contextlib
import io

import pytest


def run_kdn(*args) -> tuple:
    """`kdn ARGS` in this process (the CLI's own main): (exit status, stdout)."""
    from kdn.cli import main
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = main(list(args))
    return rc, out.getvalue()


@pytest.fixture(scope="session")
def kdn_cli():
    return run_kdn
