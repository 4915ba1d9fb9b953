"""Permanent or transient: the one rule for every failure shardline meets in storage and tasks.

A *permanent* failure fails the same way however often it is tried: no space left,
a quota, a read-only mount, no permission, a path that is not a directory (or is one),
a missing bucket, rejected credentials. Retrying it only multiplies the wait and the
noise (Spark tried each unit 4 times, Dask 3). A *transient* one may pass on the next
try: a connection reset or refused, a timeout, a 5xx answer, throttling (SlowDown).

Who uses it: prepare's and scoring's tasks return a permanent failure as data
(`as_data`, `failure_row`), so the engine sees a task that succeeded and never retries
it, and the driver raises it in one line (`raise_first`); the engines' own retries
(Spark's task attempts, Dask's `retries=`) are left to transient failures. Training's
launchers relaunch ranks only for transient ones (training.launchers.guard). Storage
calls retry transient failures with backoff (`with_backoff`; boto3's standard retry
mode does the same inside each S3 request). The CLI prints a permanent OSError that
reaches it as one line.
"""

from __future__ import annotations

import errno
import os
import sys
import time
from collections.abc import Callable
from typing import TypeVar

import pyarrow as pa

from .errors import StorageError

T = TypeVar("T")

PERMANENT_ERRNO = frozenset({
    errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS, errno.EACCES, errno.EPERM,
    errno.ENOTDIR, errno.EISDIR, errno.ENAMETOOLONG, errno.ENOENT,
})
# The same causes as an SDK or a JVM words them (pyarrow and Spark often drop the errno).
PERMANENT_TEXT = (
    "No space left", "Disk quota exceeded", "File too large", "Read-only file system",
    "Permission denied", "Access Denied", "AccessDenied", "Forbidden", "Not a directory",
    "Is a directory", "NoSuchBucket", "bucket does not exist", "InvalidAccessKeyId",
    "SignatureDoesNotMatch", "ExpiredToken",
)
TRANSIENT_TEXT = (
    "Connection reset", "Connection refused", "Connection aborted", "Connection closed by peer",
    "Broken pipe", "timed out", "Timed out", "Timeout", "Temporary failure", "SlowDown",
    "Throttl", "TooManyRequests", "RequestLimitExceeded", "ServiceUnavailable", "InternalError",
    "500 Internal", "502", "503", "504",
)
_TRANSIENT_ERRNO = frozenset({
    errno.ECONNRESET, errno.ECONNREFUSED, errno.ECONNABORTED, errno.ETIMEDOUT, errno.EPIPE,
    errno.EAGAIN, errno.EHOSTUNREACH, errno.ENETUNREACH,
})
# Marks a task's permanent failure inside the text an engine hands back.
MARK = "<<shardline-permanent>>"


def is_permanent(e: BaseException) -> bool:
    """A storage or environment failure no retry can fix (see the module's docstring).
    A failure that is neither (a bug, bad data) is not permanent here: callers decide."""
    if isinstance(e, ConnectionError | TimeoutError):
        return False
    if isinstance(e, OSError) and e.errno in PERMANENT_ERRNO:
        return True
    text = f"{type(e).__name__}: {e}"
    if MARK in text:
        return True
    return isinstance(e, (OSError, *_sdk_errors())) and any(t in text for t in PERMANENT_TEXT)


def is_transient(e: BaseException) -> bool:
    """A failure the next try may not meet: a lost connection, a timeout, a 5xx, throttling."""
    if is_permanent(e):
        return False
    if isinstance(e, ConnectionError | TimeoutError):
        return True
    if isinstance(e, OSError) and e.errno in _TRANSIENT_ERRNO:
        return True
    text = str(e)
    return any(t in text for t in TRANSIENT_TEXT)


def _sdk_errors() -> tuple[type, ...]:
    """botocore's errors, when it is imported (they are not OSErrors)."""
    boto = sys.modules.get("botocore.exceptions")
    return (boto.ClientError, boto.BotoCoreError) if boto else ()


def describe(e: BaseException) -> str:
    """One line: the error's own first line, without its Python class when it says enough."""
    lines = [ln.strip() for ln in str(e).replace(MARK, "").splitlines() if ln.strip()]
    text = lines[0] if lines else type(e).__name__
    if isinstance(e, OSError) and e.strerror and e.filename:
        text = f"{e.filename}: {e.strerror}"
        file = _file_ancestor(str(e.filename)) if e.errno in (errno.ENOTDIR, errno.EACCES) else None
        if file:  # the cause, not the symptom ("Not a directory", or a denied access())
            text = f"{e.filename}: {file} is a file, not a directory"
    return text[:300]


def _file_ancestor(path: str) -> str | None:
    """The nearest existing ancestor of local `path` when it is a regular file, else None."""
    probe = os.path.dirname(os.path.abspath(path))
    while probe and not os.path.exists(probe):
        parent = os.path.dirname(probe)
        if parent == probe:
            return None
        probe = parent
    return probe if os.path.isfile(probe) else None


def with_backoff(call: Callable[[], T], attempts: int = 4, first_s: float = 0.5) -> T:
    """`call()`, tried again after 0.5, 1, 2 s while it fails transiently; a permanent
    failure (or any other) is raised at once."""
    for attempt in range(attempts):
        try:
            return call()
        except Exception as e:
            if attempt == attempts - 1 or not is_transient(e):
                raise
        time.sleep(first_s * 2**attempt)
    raise AssertionError("unreachable")


# -- tasks: a permanent failure comes back as data, so no engine retries it ---------------


class as_data:
    """fn, but a permanent failure is returned as {MARK: line} instead of raised: the
    engine sees a task that succeeded and never retries it. Picklable when fn is."""

    def __init__(self, fn: Callable):
        self.fn = fn

    def __call__(self, *args, **kwargs):
        try:
            return self.fn(*args, **kwargs)
        except Exception as e:
            if not is_permanent(e):
                raise
            return {MARK: describe(e)}


def raise_first(results: list, what: str) -> list:
    """`results` of `as_data` tasks; the first permanent failure among them raised in one line."""
    for r in results:
        if isinstance(r, dict) and MARK in r:
            raise StorageError(f"{what}: {r[MARK]} (not retried: trying again cannot fix it)")
    return results


def failure_rows(write: Callable, schema, error_column: str = "error"):
    """write(table) -> record batches of `schema`, but a permanent failure ends it with one
    row whose `error_column` holds the line (and nothing else): see `as_data`."""
    return _FailureRows(write, schema, error_column)


class _FailureRows:
    def __init__(self, write, schema, error_column):
        self.write, self.schema, self.error_column = write, schema, error_column

    def __call__(self, *args, **kwargs):
        try:
            yield from self.write(*args, **kwargs)
        except Exception as e:
            if not is_permanent(e):
                raise
            yield pa.RecordBatch.from_pylist([{self.error_column: describe(e)}], schema=self.schema)
