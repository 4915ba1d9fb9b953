"""MLflow outages: tracking calls that are bounded in time and kept while the server is down.

MLflow's HTTP client retries a dead server with exponential backoff for minutes per
call (7 retries, a 120 s timeout each, by default). A rank blocked there stops
training; a driver blocked there cannot restart a lost rank. So:

- `bound_http()` gives every shardline process short MLflow HTTP settings (2 retries,
  a 10 s timeout) unless the user set them (`MLFLOW_HTTP_REQUEST_*`).
- `Outbox` tries each tracking call once; when the server is unreachable it keeps the
  call, in order, and sends everything kept before the next call, at most once per
  `RETRY_S`, so a down server costs a rank one bounded attempt every half minute and
  training, checkpoints and restarts go on. Calls that fail for another reason (a bad
  value) still raise.
- What rank 0 still holds when it finishes goes back to the driver as plain data
  (`pending()`); the driver sends it (`replay`), waiting up to
  `tracking.outage_wait_s` for the server, and otherwise ends in one line naming the
  checkpoint that holds the trained weights.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time

from shardline.foundation import report
from shardline.foundation.errors import ShardlineError, first_line
from shardline.foundation.redact import redact

BOUNDED = {
    "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2",
    "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
    "MLFLOW_HTTP_REQUEST_TIMEOUT": "10",
}
RETRY_S = 30.0
# The driver, done training, only waits for the server: it tries again every second, so a
# server that is back is used at once (a try at a dead one is a refused connection, or at
# most MLflow's bounded retries, not a load on anything).
DRIVER_RETRY_S = 1.0

_UNREACHABLE = ("Max retries exceeded", "Connection refused", "ConnectionError", "timed out",
                "Read timed out", "RemoteDisconnected", "Connection aborted", "Temporary failure",
                "Name or service not known", "502", "503", "504")


def bound_http() -> None:
    for k, v in BOUNDED.items():
        os.environ.setdefault(k, v)
    # urllib3 logs each retry of a dead server ("Retrying (Retry(total=1, ...)) after connection
    # broken by ..."), 3 lines a call: an outage is said once, in shardline's words, instead.
    logging.getLogger("urllib3.connectionpool").setLevel(logging.ERROR)


def unreachable(e: BaseException) -> bool:
    """The server did not answer (or answered only as a gateway can): keep the call."""
    import requests

    if isinstance(e, (requests.exceptions.ConnectionError, requests.exceptions.Timeout, ConnectionError, TimeoutError)):
        return True
    text = str(e)
    return any(marker in text for marker in _UNREACHABLE)


class Outbox:
    """Tracking calls to one server, in order, kept while it is unreachable.

    Entries are plain data (`("batch", run_id, [(key, value, ms, step), ...])`,
    `("tag", run_id, key, value)`), so what is left can be pickled back to the driver.
    """

    def __init__(self, client, retry_s: float = RETRY_S):
        self.client = client
        self.retry_s = retry_s
        self._kept: list[tuple] = []
        self._next_try = 0.0
        self.down_since: float | None = None

    def send(self, entry: tuple) -> None:
        self._kept.append(entry)
        self.flush()

    def flush(self, force: bool = False) -> bool:
        """Send what is kept, oldest first; False if the server is (still) unreachable."""
        if not force and time.monotonic() < self._next_try:
            return not self._kept
        while self._kept:
            try:
                _apply(self.client, self._kept[0])
            except Exception as e:
                if not unreachable(e):
                    raise
                self._next_try = time.monotonic() + self.retry_s
                if self.down_since is None:
                    self.down_since = time.monotonic()
                return False
            self._kept.pop(0)
        self.down_since = None
        return True

    def pending(self) -> list[tuple]:
        return list(self._kept)


def _apply(client, entry: tuple) -> None:
    from mlflow.entities import Metric

    kind, run_id, *rest = entry
    if kind == "batch":
        client.log_batch(run_id, metrics=[Metric(k, v, ms, step) for k, v, ms, step in rest[0]], synchronous=True)
    elif kind == "tag":
        client.set_tag(run_id, rest[0], rest[1])
    else:
        raise ValueError(f"unknown tracking entry {kind!r}")


def replay(tracking_uri: str, entries: list[tuple], wait_s: float, checkpoint: str | None) -> None:
    """The driver sends what rank 0 could not, waiting up to `wait_s` for the server."""
    from mlflow.tracking import MlflowClient

    if not entries:
        return
    box = Outbox(MlflowClient(tracking_uri), retry_s=DRIVER_RETRY_S)
    box._kept = list(entries)
    waiting = _Waiting(tracking_uri, wait_s, checkpoint)
    while not box.flush(force=True):
        if waiting.over():
            raise _gone(tracking_uri, wait_s, checkpoint, f"{len(box.pending())} tracking call(s) not sent")
        waiting.say(f"{len(box.pending())} tracking call(s) to send")
        time.sleep(DRIVER_RETRY_S)


def when_reachable(call, tracking_uri: str, wait_s: float, checkpoint: str | None,
                   retry_s: float = DRIVER_RETRY_S):
    """`call()`, one of the driver's own calls after training (the curves, the model and its
    version), tried again every `retry_s` while the server is unreachable, up to `wait_s`: a
    server that goes down as training ends is waited for as one that went down during it.
    (A call whose answer was lost after the server acted on it is made twice: for the
    model, a second version; a refused connection, the usual outage, never acted.)"""
    waiting = _Waiting(tracking_uri, wait_s, checkpoint)
    while True:
        try:
            return call()
        except Exception as e:
            if not unreachable(e):
                raise
            if waiting.over():
                raise _gone(tracking_uri, wait_s, checkpoint, first_line(e)) from None
            waiting.say(first_line(e))
        time.sleep(retry_s)


class _Waiting:
    """The driver's wait for an unreachable server, said on the console when it starts and
    every `every_s` after: a wait of minutes must not look like a hang."""

    def __init__(self, tracking_uri: str, wait_s: float, checkpoint: str | None, every_s: float = 30.0):
        self.uri, self.wait_s, self.checkpoint, self.every_s = tracking_uri, wait_s, checkpoint, every_s
        self.start = time.monotonic()
        self.said = None

    def over(self) -> bool:
        return time.monotonic() - self.start >= self.wait_s

    def say(self, detail: str) -> None:
        now = time.monotonic()
        if self.said is not None and now - self.said < self.every_s:
            return
        left = max(0.0, self.wait_s - (now - self.start))
        first = self.said is None
        self.said = now

        report.line(redact(f"[shardline] training is done; MLflow at {self.uri} is unreachable ({detail}): "
                           f"{'waiting' if first else 'still waiting'} up to {left:.0f} s more for it "
                           f"(tracking.outage_wait_s); the trained weights are in checkpoint "
                           f"{self.checkpoint or 'training.checkpoint_dir'}"))


@contextlib.contextmanager
def tracked_run(run_id: str | None, run_name: str | None, tracking_uri: str, wait_s: float, checkpoint):
    """`mlflow.start_run(...)` for the driver, whose end survives an outage: a job that fails
    (the server gone for good among the causes) ends with its own error, not with MLflow's
    failure to mark the run FAILED chained onto it; a job that succeeded marks its run
    FINISHED once the server answers (`when_reachable`). checkpoint: a callable giving the
    newest checkpoint, for the line said while waiting."""
    import mlflow
    from mlflow.tracking import MlflowClient

    run = mlflow.start_run(run_id=run_id, run_name=run_name)
    try:
        yield run
    except BaseException:
        with contextlib.suppress(Exception):  # the job's own error is the one to show
            mlflow.end_run("FAILED")
        raise
    try:
        mlflow.end_run("FINISHED")  # leaves the active run first, then tells the server
    except Exception as e:
        if not unreachable(e):
            raise
        when_reachable(lambda: MlflowClient(tracking_uri).set_terminated(run.info.run_id, "FINISHED"),
                       tracking_uri, wait_s, checkpoint())


def _gone(tracking_uri: str, wait_s: float, checkpoint: str | None, detail: str):
    return ShardlineError(redact(
        f"tracking.tracking_uri: MLflow at {tracking_uri} has been unreachable since training "
        f"was running ({detail}, waited {wait_s:.0f} s at the end); the trained weights are in "
        f"checkpoint {checkpoint or 'training.checkpoint_dir'}, the model is not registered"
    ))
