"""Errors (kdn/core/errors.py): one base, one subclass per problem, messages not quoted."""
import inspect

from kdn.core import errors


def test_every_error_is_a_kdn_error():
    classes = [c for _, c in inspect.getmembers(errors, inspect.isclass) if c.__module__ == errors.__name__]
    assert len(classes) > 15
    assert all(issubclass(c, errors.KDNError) for c in classes)


def test_key_errors_print_their_message_as_written():
    assert str(errors.ChunkNotFound("no chunk abc")) == "no chunk abc"
    assert str(errors.VersionNotFound("no version 3")) == "no version 3"
    assert isinstance(errors.ChunkNotFound("x"), KeyError)
