"""User-facing errors. The CLI prints these as one line; anything else is a bug."""

from .redact import redact


class ShardlineError(Exception):
    """A mistake in the user's input, config or environment (exit code 1).

    Its text has URI passwords, tokens and secret query values masked when it is made
    (foundation.redact): a Python caller's traceback, a notebook or a log shows the
    error as it is, not only the CLI's last line."""

    exit_code = 1

    def __init__(self, *args):
        super().__init__(*(redact(a) if isinstance(a, str) else a for a in args))


class ConfigError(ShardlineError):
    """A config file that is missing, unparsable or invalid (exit code 2)."""

    exit_code = 2


class DataError(ShardlineError):
    """Raw data or a prepared dataset that cannot be used as it is."""


class StorageError(ShardlineError):
    """Storage that cannot be used: unreachable, a missing bucket, credentials, permissions."""


class LeaseHeld(ShardlineError):
    """Another job holds the lease (the lock) of a directory (exit code 75, EX_TEMPFAIL: try later)."""

    exit_code = 75


def first_line(e: BaseException, limit: int = 300, *, with_type: bool = False) -> str:
    """An exception as one short line for a message: its text's first non-empty line, cut at
    `limit` characters; its type's name when it has no text (`raise ValueError()`, `KeyError`
    of nothing): this never raises, whatever `e` holds. with_type: "TypeName: text" (for a
    cause whose text alone does not say what failed)."""
    try:
        whole = str(e)
    except Exception:  # an exception class whose __str__ fails: its name still says something
        whole = ""
    text = next((ln.strip() for ln in whole.splitlines() if ln.strip()), "")
    kind = type(e).__name__
    if not text:
        return kind
    return f"{kind}: {text[:limit]}" if with_type else text[:limit]
