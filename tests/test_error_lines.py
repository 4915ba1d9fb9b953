"""One line from any exception (#53 item 6, #54 item 8): foundation.errors.first_line is the
one helper every "(its cause)" in a refusal goes through. Its copies took
`str(e).splitlines()[0]`, which raised IndexError for an exception without a message (a bare
`raise ValueError()`), so the refusal itself became a traceback."""

from __future__ import annotations

import pytest

from shardline.foundation.errors import first_line


class _Unprintable(Exception):
    def __str__(self):
        raise RuntimeError("no text")


@pytest.mark.parametrize("error, line", [
    (ValueError(), "ValueError"),
    (ValueError(""), "ValueError"),
    (ValueError("\n  \n"), "ValueError"),
    (OSError("\n  disk full  \nat write()"), "disk full"),
    (_Unprintable(), "_Unprintable"),
    (KeyError("k"), "'k'"),
])
def test_first_line_is_the_first_line_with_text_else_the_type(error, line):
    assert first_line(error) == line


def test_first_line_with_its_type_and_cut_at_a_limit():
    assert first_line(ValueError("depth must be at least 1"), with_type=True) == "ValueError: depth must be at least 1"
    assert first_line(TimeoutError(), with_type=True) == "TimeoutError"
    assert first_line(ValueError("x" * 500), 20) == "x" * 20


def test_the_errors_a_caller_catches_are_shardlines_own_names():
    """#53 item 20: docs/guide/api.md says a refused call raises `shardline.ShardlineError`;
    it, its subclasses and the failures of a call that ran are importable from `shardline`."""
    import shardline
    from shardline.foundation import errors
    from shardline.foundation.lease import LeaseLost
    from shardline.training.launchers import TrainingFailed

    for name in ("ShardlineError", "ConfigError", "DataError", "StorageError", "LeaseHeld"):
        assert getattr(shardline, name) is getattr(errors, name) and name in shardline.__all__
    assert shardline.LeaseLost is LeaseLost and shardline.TrainingFailed is TrainingFailed
    assert issubclass(shardline.TrainingFailed, shardline.ShardlineError)
    with pytest.raises(shardline.ShardlineError, match="unknown setting 'training.epochz'"):
        shardline.load_config(None, ["training.epochz=3"])
