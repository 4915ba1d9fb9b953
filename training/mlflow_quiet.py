"""MLflow's own chatter kept out of shardline's output.

shardline says what it did in its own lines (the CLI's `run …; model models:/m/3`); MLflow,
called underneath, would add its own to the same stderr: "Downloading artifacts: 100%|…"
bars whenever a model is read (so a one-line refusal of a pickled model became two lines),
and "Successfully registered model 'm'." / "Created version '3' of model 'm'." on every
registration. A user who wants the bars back sets MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager


def no_download_bars() -> None:
    """No artifact progress bars in this process unless the user asked for them."""
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")


@contextmanager
def registry_said_nothing() -> Iterator[None]:
    """MLflow's event lines off while a model is registered. They go through one stream of
    MLflow's (`eprint`, and its loggers' handler), which it lets a caller switch off; what
    fails still raises, and the stream is put back as it was."""
    from mlflow.utils.logging_utils import MLFLOW_LOGGING_STREAM

    was = MLFLOW_LOGGING_STREAM.enabled
    MLFLOW_LOGGING_STREAM.enabled = False
    try:
        yield
    finally:
        MLFLOW_LOGGING_STREAM.enabled = was
