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
