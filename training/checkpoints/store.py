"""A job's checkpoint folder, owned by one object: `CheckpointStore`.

Each checkpoint is a small object and a directory beside it. Every rank writes its
weights and optimizer state into the directory itself, with torch.distributed.checkpoint
(training.checkpoints.sharded); the small object holds the rest — position, each rank's
schedule and RNG, the fingerprint and the code's per-file digests — in plain tensors,
numbers and strings only, so `torch.load(weights_only=True)` reads it: loading a
checkpoint never unpickles arbitrary objects. Both go through `foundation.storage`, so the
folder may be any URL:

    checkpoint_dir/
      ckpt-000000120-3f9a1c.pt   the small object, new per checkpoint (step, then a fresh suffix)
      ckpt-000000120-7d02ee.dcp/ its ranks' weights and optimizer state (named in the object)
      LATEST                     the pointer: written after the object it names
      ranks/rank-N.json          which host and process is rank N
      ranks/rank-N.log           rank N's traceback, when it failed with a bug (launchers.rank_errors)
      ranks/stop.json            the job whose driver was interrupted: its ranks stop (launchers.guard)
      _lease.json                the running job's hold on the folder (foundation.lease)

A checkpoint is visible once the pointer names it: an interrupted write leaves at most an
object nothing points to. Rotation keeps the newest `keep` and never deletes what the
pointer names; DCP directories no kept object can name go with it. `latest()` follows the
pointer (a folder with no pointer, such as one written by an earlier shardline or copied
by hand, falls back to the newest object by step). `readable()` is the one a job resumes
from: the pointed one, or, when that cannot be read (truncated, corrupted), the newest
older one that can, said in one line. The pointer also carries the writer's fingerprint,
epoch and code digests, so whose folder this is, whether its job is finished and whether
its code changed are answered without reading a checkpoint.

Whose folder: a new job clears only its own earlier checkpoints; a folder whose `LATEST`
names another job's (other fingerprint settings) is refused, never emptied. `own` (the
folder is the job's own, training.checkpoints.fingerprint.job_dir, checkpoint_dir unset) lets a new
run replace an earlier one that differs only in what the folder's name leaves out.

Checks and effects are separate methods: every read and every `check_*` only reads the
folder, so a driver can run all its checks before it writes, deletes, holds or launches
anything; each effect (`hold`/`release`, `start_over`, `clear`, `save`, `prune`,
`announce`) does what it says.
"""

from __future__ import annotations

import io
import json
import os
import re
import socket
import sys
import uuid
from dataclasses import dataclass, field

# No `import torch` here (save and read import it): the driver's checks read JSON.
from shardline.foundation import storage
from shardline.foundation.code_travel import UserCode
from shardline.foundation.errors import DataError, StorageError
from shardline.foundation.lease import LEASE_NAME, Lease

from .fingerprint import (
    SAME_JOB_FIELDS,
    CheckpointUnreadable,
    NOT_IN_FOLDER_NAME,
    allow_hint,
    code_refusal,
    differences,
    upgraded,
    job_dir,
)
from ..config import TrainingConfig

_NAME = re.compile(r"^ckpt-(\d{9})(-[0-9a-f]{6})?\.pt$")
_SHARDED = re.compile(r"^ckpt-\d{9}-[0-9a-f]{6}\.dcp$")  # the DCP directory CheckpointStore.new_dcp_name names
POINTER = "LATEST"
DCP_SUFFIX = ".dcp"

_FALLBACKS_SAID: set[tuple[str, str]] = set()


def error_cause(e: BaseException) -> str:
    """An error's type and first line, for the one line that says a store failed."""
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0][:160]}" if text else type(e).__name__


@dataclass
class CheckpointStore:
    """One checkpoint folder (`url`, resolved) and whether it is the job's own (`own`).

    Picklable until held: ranks make their own from the folder's URL."""

    url: str
    own: bool = False
    lease: Lease | None = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.url = str(self.url)  # a pathlib.Path is welcome too

    @classmethod
    def for_job(cls, cfg: TrainingConfig, experiment: str, registered_model: str, dataset_dir: str) -> CheckpointStore:
        """`training.checkpoint_dir` as set, else the job's own folder (job_dir), resolved."""
        if "checkpoint_dir" in cfg.model_fields_set:
            return cls(storage.resolve(cfg.checkpoint_dir, "training.checkpoint_dir"))
        own = job_dir(cfg, experiment, registered_model, dataset_dir)
        return cls(storage.resolve(own, "training.checkpoint_dir"), own=True)

    @classmethod
    def holding(cls, checkpoint_url: str) -> CheckpointStore:
        """The store of the folder a checkpoint (its small file's URL) is in."""
        return cls(storage.parent(checkpoint_url))

    @property
    def where(self) -> str:
        return storage.display(self.url)

    # -- reads ---------------------------------------------------------------------------

    def paths(self) -> list[str]:
        """Checkpoint URLs, oldest first: by step, then by time written (a step can have two:
        mid-epoch and the epoch's end, or one from before a restart)."""
        found = [
            (int(m.group(1)), i.mtime_ns or 0, i.base_name)
            for i in storage.list_dir_info(self.url) if (m := _NAME.match(i.base_name))
        ]
        return [storage.join(self.url, n) for *_, n in sorted(found)]

    def latest(self) -> str | None:
        """The checkpoint the pointer names, else the newest by step, else None."""
        pointer_url = storage.join(self.url, POINTER)
        try:
            pointed = json.loads(storage.read_bytes(pointer_url))["name"]
        except FileNotFoundError:
            paths = self.paths()
            return paths[-1] if paths else None
        except (ValueError, KeyError, TypeError):
            raise DataError(f"{storage.display(pointer_url)}: not a checkpoint pointer") from None
        # The name is joined to the folder and loaded (torch.load): anyone who can write the
        # store could point it elsewhere (../, an absolute path). Only our own names are followed.
        if not isinstance(pointed, str) or not _NAME.fullmatch(pointed):
            raise DataError(
                f"{storage.display(pointer_url)}: corrupt checkpoint pointer (name {pointed!r} is not a "
                "ckpt-<step>.pt in its folder); not followed: remove it to resume from the newest checkpoint there"
            )
        return storage.join(self.url, pointed)

    def owner(self) -> dict[str, str] | None:
        """The fingerprint of the job whose checkpoints the folder holds; None when it holds none."""
        pointer = self._pointer()
        if isinstance(pointer.get("fingerprint"), dict):
            return pointer["fingerprint"]
        newest = self.latest()  # a pointer from before fingerprints were in it, or none
        return None if newest is None else self.read(newest).get("fingerprint", {})

    def read(self, url: str, expected: dict[str, str] | None = None, allow_changed=()) -> dict:
        """Read the checkpoint at `url` (one of this folder's) and refuse one written for
        another model, config, dataset or code (fields in `allow_changed` may differ)."""
        import torch

        where = storage.display(url)
        try:
            with storage.open_input(url) as f:
                state = torch.load(io.BytesIO(f.read()), map_location="cpu", weights_only=True)
        except FileNotFoundError:
            raise CheckpointUnreadable(f"{where}: checkpoint not found") from None
        except Exception as e:
            raise CheckpointUnreadable(f"{where}: not a readable shardline checkpoint ({error_cause(e)})") from None
        got = upgraded(state.get("fingerprint", {}))
        differ = differences(got, expected or {})
        refused = [k for k in differ if k not in allow_changed]
        if refused:
            raise DataError(
                f"{where}: checkpoint is from a different run: "
                + ", ".join(f"{k}={got.get(k)!r} (config has {(expected or {})[k]!r})" for k in refused)
                + allow_hint(differ)
            )
        # The weights are in the DCP directory the small file names (training.checkpoints.sharded),
        # whose .metadata is written last: without it the checkpoint cannot be resumed.
        sharded = state.get("sharded")
        if sharded is not None:
            self.dcp_dir(url, state)  # a name of ours, or refused
        if isinstance(sharded, str) and not storage.exists(storage.join(self.dcp_dir(url, state), ".metadata")):
            raise CheckpointUnreadable(f"{where}: its DCP directory {sharded} is missing or incomplete (no .metadata)")
        return state

    def readable(self, expected: dict[str, str] | None = None, allow_changed=()) -> tuple[str, dict] | None:
        """The checkpoint to resume from and its state: the one the pointer names, else (it
        cannot be read) the newest older one that can, said in one line. None: no checkpoint.
        A checkpoint of another run is refused, never skipped: an older one would be too."""
        first = self.latest()
        if first is None:
            return None
        try:
            return first, self.read(first, expected, allow_changed)
        except CheckpointUnreadable as e:
            bad = e
        for url in reversed([p for p in self.paths() if p != first]):
            try:
                state = self.read(url, expected, allow_changed)
            except CheckpointUnreadable:
                continue
            # Said once per process: the driver's checks (a finished job?) and the launch
            # both look for the checkpoint to resume from.
            if (first, url) not in _FALLBACKS_SAID:
                _FALLBACKS_SAID.add((first, url))
                print(f"[shardline] {bad}; resuming from {storage.name(url)}, the newest readable one",
                      file=sys.stderr, flush=True)
            return url, state
        raise CheckpointUnreadable(f"{bad}; no older checkpoint in {self.where} is readable either")

    def dcp_dir(self, head_url: str, head: dict) -> str:
        """The DCP directory of the checkpoint at `head_url` (its state: `head`). The name is
        joined to the folder and read by every rank: like LATEST's, only our own is followed."""
        name = head["sharded"]
        if not isinstance(name, str) or not _SHARDED.fullmatch(name):
            raise CheckpointUnreadable(f"{storage.display(head_url)}: corrupt checkpoint (DCP directory {name!r} "
                                       "is not a ckpt-<step>-<id>.dcp in its folder); not followed")
        return storage.join(storage.parent(head_url), name)

    def code_changes(self, code: UserCode) -> list[str] | None:
        """How `code` differs from the newest checkpoint's, a phrase a file
        (UserCode.changes; [] when the same); None when that checkpoint was written
        before the code was fingerprinted, so it cannot be compared."""
        newest = self._newest()
        theirs = newest.get("fingerprint") or {}
        if "code" not in theirs:
            return None
        if theirs["code"] == code.digest:
            return []
        files = newest.get("code_files")
        if not isinstance(files, dict) or not code.changes(files):  # only the digest kept
            return [f"code digest {str(theirs['code'])[:12] or '(none)'} -> {code.digest[:12] or '(none)'}"]
        return code.changes(files)

    # -- checks: read only ----------------------------------------------------------------

    def check_new(self, fp: dict[str, str]) -> list[str]:
        """Refuse the folder to a new job when it holds another job's checkpoints (which
        starting over would delete). Returns what an earlier run of this job differed in,
        when the folder is the job's own (`own`) and those are all left out of its name:
        that run is this job's, which a new run replaces."""
        theirs = self.owner()
        if not theirs:  # {}: written without a fingerprint, which no job can resume
            return []
        theirs = upgraded(theirs)
        diff = differences(theirs, fp, ignore=SAME_JOB_FIELDS)
        if self.own and all(k in NOT_IN_FOLDER_NAME for k in diff):
            return [f"{k} {theirs.get(k)}" for k in diff]
        if diff:
            said = [f"{k} {theirs.get(k)!r} (this job: {fp[k]!r})" for k in diff]
            raise DataError(
                f"training.checkpoint_dir {self.where} holds another job's checkpoints "
                f"({', '.join(said[:3])}{', ...' if len(said) > 3 else ''}); a new job would delete them: "
                "give this job a checkpoint_dir of its own (unset, each job gets one under "
                "shardline-data/checkpoints/<experiment>/), resume that job with --resume, or delete them yourself"
            )
        return []

    def check_resume(self, fp: dict[str, str], code: UserCode, epochs: int, allow_changed=()) -> None:
        """A resume has a checkpoint to continue, over the same code (unless `code` is
        allowed to change), and something left to train. The other settings are compared
        with the checkpoint it resumes from (`read`)."""
        if self.latest() is None:
            raise DataError(f"{self.where}: no checkpoint to resume from")
        self.check_code(code, allow_changed)
        self.check_unfinished(epochs, allow_changed, fp)

    def check_code(self, code: UserCode, allow_changed=()) -> None:
        """Refuse a resume whose code changed since the newest checkpoint, naming the files."""
        changes = self.code_changes(code)
        if changes and "code" not in allow_changed:
            raise code_refusal(self.where, changes)

    def check_unfinished(self, epochs: int, allow_changed=(), fp: dict[str, str] | None = None) -> None:
        """Refuse a resume whose newest checkpoint already ends the job (its last epoch done):
        it would take 0 steps and register the same weights as a new version. fp: this job's
        fingerprint; a checkpoint of another run is left to `read`'s refusal, which names it."""
        newest = self._newest()
        epoch, theirs = newest.get("epoch"), newest.get("fingerprint")
        if fp and isinstance(theirs, dict) and differences(theirs, fp, ignore=(*allow_changed, "dataset_version")):
            return
        if epoch is None or epoch < epochs:
            return
        more = ("raise training.epochs (e.g. --set training.epochs={n} --allow-changed epochs)"
                if "epochs" not in allow_changed else "raise training.epochs").format(n=epoch + 1)
        raise DataError(
            f"{self.where}: the newest checkpoint ends the job (epoch {epoch} of training.epochs = {epochs} "
            f"done): a resume would train 0 steps; to train further, {more}; to start over, train without --resume"
        )

    # -- effects ----------------------------------------------------------------------------

    def hold(self, ttl_s: float) -> Lease:
        """The folder's lease for this job (one job per folder): a second job is refused
        (LeaseHeld, exit 75) naming the holder; a folder that cannot be written ends here, in
        one line. Renewed until `release`."""
        if self.lease is not None:
            return self.lease
        lease = Lease(storage.join(self.url, LEASE_NAME), f"shardline train {uuid.uuid4().hex[:8]}", ttl_s=ttl_s,
                      what="training.checkpoint_dir")
        try:
            self.lease = lease.acquire()
        except OSError as e:
            raise StorageError(
                f"training.checkpoint_dir {self.where}: cannot write there ({e.strerror or type(e).__name__})"
            ) from None
        return self.lease

    def release(self) -> None:
        if self.lease is not None:
            self.lease.release()
            self.lease = None

    def start_over(self, fp: dict[str, str]) -> None:
        """A new job's folder: drop its own earlier checkpoints (its restarts would resume
        them), said in one line when they were an earlier run's; refuse (check_new) a folder
        holding another job's, which clearing would lose."""
        replaced = self.check_new(fp)
        if replaced:
            print(f"[shardline] starting over in this job's own checkpoint folder {self.where}: the checkpoints "
                  f"of its earlier run ({', '.join(replaced)}) are replaced (--resume --allow-changed would have "
                  "continued them)", file=sys.stderr, flush=True)
        self.clear()

    def clear(self) -> None:
        """Drop every checkpoint (pointer first) and every DCP directory."""
        storage.delete(storage.join(self.url, POINTER))
        for old in self.paths():
            storage.delete(old)
        self.prune()

    def save(self, global_step: int, state: dict, keep: int) -> str:
        """Write a new checkpoint object (its DCP directory, named in `state`, is already
        written), then point LATEST at it, then rotate; its URL. Rank 0."""
        import torch

        buf = io.BytesIO()
        torch.save(state, buf)
        name = f"ckpt-{global_step:09d}-{uuid.uuid4().hex[:6]}.pt"
        url = storage.join(self.url, name)
        try:
            storage.write_bytes(url, buf.getbuffer())
            # The pointer is the commit: one whole-object write (a rename locally) after the
            # object. What it carries besides says whose folder this is, how far its job got
            # and what code wrote it, without reading a checkpoint.
            pointer = {"name": name, "step": global_step, "epoch": state.get("epoch"),
                       "fingerprint": state.get("fingerprint", {}), "code_files": state.get("code_files", {})}
            storage.write_bytes(storage.join(self.url, POINTER), json.dumps(pointer).encode())
        except OSError as e:  # a full disk, a read-only mount, no permission: no restart fixes it
            raise StorageError(f"training.checkpoint_dir: cannot write {storage.display(url)} ({error_cause(e)})") from None
        for old in self.paths()[:-keep]:
            if old != url:
                storage.delete(old)
        self.prune()
        return url

    def prune(self) -> None:
        """Remove the DCP directories no kept checkpoint can name: those older than the
        oldest one kept (every one, when none is). A directory a lost attempt wrote at a kept
        step goes once that step is rotated out."""
        heads = self.paths()
        oldest = _step(storage.name(heads[0])) if heads else None
        for info in storage.list_dir_info(self.url):
            name = info.base_name
            if name.startswith("ckpt-") and name.endswith(DCP_SUFFIX) and (oldest is None or _step(name) < oldest):
                storage.delete_tree(storage.join(self.url, name))

    def new_dcp_name(self, global_step: int) -> str:
        """A fresh DCP directory name, the same on every rank (rank 0's). Collective."""
        from .. import collectives

        mine = f"ckpt-{global_step:09d}-{uuid.uuid4().hex[:6]}{DCP_SUFFIX}"
        return collectives.all_gather_object(mine)[0]

    def announce(self, rank: int) -> None:
        """ranks/rank-N.json: which host and process is rank N (to watch or signal it)."""
        info = {"rank": rank, "host": socket.gethostname(), "pid": os.getpid()}
        storage.write_bytes(storage.join(self.url, "ranks", f"rank-{rank}.json"), json.dumps(info).encode())

    # -- internals --------------------------------------------------------------------------

    def _pointer(self) -> dict:
        """LATEST as written; {} when there is none or it is damaged (latest() names the damage)."""
        try:
            pointer = json.loads(storage.read_bytes(storage.join(self.url, POINTER)))
        except (FileNotFoundError, ValueError):
            return {}
        return pointer if isinstance(pointer, dict) else {}

    def _newest(self) -> dict:
        """The newest checkpoint's epoch, fingerprint and code digests: the pointer's, else
        (a pointer from before it carried them, or none) the checkpoint's it resumes from."""
        pointer = self._pointer()
        if isinstance(pointer.get("fingerprint"), dict) and pointer.get("epoch") is not None:
            return pointer
        found = self.readable()
        if found is None:
            return {}
        state = found[1]
        return {"epoch": state.get("epoch"), "fingerprint": state.get("fingerprint", {}),
                "code_files": state.get("code_files")}


def _step(name: str) -> int:
    return int(name.split("-")[1].split(".")[0])
