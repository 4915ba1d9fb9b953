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
