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

Checks and effects are separate methods: every read and every `check_*` (whose folder it
is and whether a resume may continue it: training.checkpoints.whose) only reads the folder, so a driver can run all its checks before it writes, deletes, holds or launches
anything; each effect (`hold`/`release`, `start_over`, `clear`, `save`, `prune`,
`announce`) does what it says.
"""

from __future__ import annotations

import io
import json
import os
import re
import socket
import uuid
from dataclasses import dataclass, field

# No `import torch` here (save and read import it): the driver's checks read JSON.
from shardline.foundation import report, storage
from shardline.foundation.errors import DataError, StorageError, first_line
from shardline.foundation.lease import LEASE_NAME, Lease

from .fingerprint import CheckpointUnreadable, ResumeRefused, allow_hint, differences, job_dir, upgraded
from .whose import WhoseFolder
from ..config import TrainingConfig

# Imported inside the functions that use them: torch (~2 s: only where a model or a rank runs);
# training.collectives (imports torch).

_NAME = re.compile(r"^ckpt-(\d{9})(-[0-9a-f]{6})?\.pt$")
_SHARDED = re.compile(r"^ckpt-\d{9}-[0-9a-f]{6}\.dcp$")  # the DCP directory CheckpointStore.new_dcp_name names
POINTER = "LATEST"
DCP_SUFFIX = ".dcp"
RANKS = "ranks"  # the ranks' own files: who they are, a bug's traceback, the stop request
STOP_NAME = "stop.json"

_FALLBACKS_SAID: set[tuple[str, str]] = set()


@dataclass
class CheckpointStore(WhoseFolder):
    """One checkpoint folder (`url`, resolved) and whether it is the job's own (`own`).

    Picklable until held: ranks make their own from the folder's URL."""

    url: str
    own: bool = False
    lease: Lease | None = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.url = str(self.url)  # a pathlib.Path is welcome too

    @staticmethod
    def job_folder(cfg: TrainingConfig, experiment: str, registered_model: str, dataset_dir: str) -> tuple[str, bool]:
        """The one place a job's folder is decided: `training.checkpoint_dir` as the config
        writes it, else the job's own (job_dir: two configs never share, or clear, each
        other's checkpoints); as written, not resolved, and whether it is the job's own."""
        if "checkpoint_dir" in cfg.model_fields_set:
            return cfg.checkpoint_dir, False
        return job_dir(cfg, experiment, registered_model, dataset_dir), True

    @classmethod
    def for_job(cls, cfg: TrainingConfig, experiment: str, registered_model: str, dataset_dir: str) -> CheckpointStore:
        """The store of the job's folder (job_folder), resolved."""
        folder, own = cls.job_folder(cfg, experiment, registered_model, dataset_dir)
        return cls(storage.resolve(folder, "training.checkpoint_dir"), own=own)

    @classmethod
    def holding(cls, checkpoint_url: str) -> CheckpointStore:
        """The store of the folder a checkpoint (its small file's URL) is in."""
        return cls(storage.parent(checkpoint_url))

    @property
    def where(self) -> str:
        return storage.display(self.url)

    @property
    def ranks_dir(self) -> str:
        """Where each rank says who it is (rank-N.json) and, failing with a bug, writes its
        traceback (rank-N.log: launchers.rank_errors); every host can write there."""
        return storage.join(self.url, RANKS)

    def rank_file(self, rank: int) -> str:
        """ranks/rank-N.json: which host and process is rank N (announce)."""
        return storage.join(self.ranks_dir, f"rank-{rank}.json")

    @property
    def stop_file(self) -> str:
        """ranks/stop.json: the job whose driver was interrupted; its ranks stop (launchers.guard)."""
        return storage.join(self.ranks_dir, STOP_NAME)

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
            raise CheckpointUnreadable(f"{where}: not a readable shardline checkpoint ({first_line(e, 160, with_type=True)})") from None
        got = upgraded(state.get("fingerprint", {}))
        differ = differences(got, expected or {})
        refused = [k for k in differ if k not in allow_changed]
        if refused:  # only a resume passes `expected`
            raise ResumeRefused(
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
                report.line(f"[shardline] {bad}; resuming from {storage.name(url)}, the newest readable one")
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
            report.line(f"[shardline] starting over in this job's own checkpoint folder {self.where}: the "
                        f"checkpoints of its earlier run ({', '.join(replaced)}) are replaced (--resume "
                        "--allow-changed would have continued them)")
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
            self._point(name, global_step, state)
        except OSError as e:  # a full disk, a read-only mount, no permission: no restart fixes it
            raise StorageError(f"training.checkpoint_dir: cannot write {storage.display(url)} ({first_line(e, 160, with_type=True)})") from None
        for old in self.paths()[:-keep]:
            if old != url:
                storage.delete(old)
        self.prune()
        return url

    def point_at(self, url: str) -> None:
        """Make the checkpoint at `url` (one of this folder's) the newest: LATEST names it,
        with what save() would have written (a copied folder, a test's or the fault runner's)."""
        state = self.read(url)
        self._point(storage.name(url), int(state["global_step"]), state)

    def _point(self, name: str, global_step: int, state: dict) -> None:
        # The pointer is the commit: one whole-object write (a rename locally) after the
        # object. What it carries besides says whose folder this is, how far its job got
        # and what code wrote it, without reading a checkpoint.
        pointer = {"name": name, "step": global_step, "epoch": state.get("epoch"),
                   "fingerprint": state.get("fingerprint", {}), "code_files": state.get("code_files", {})}
        storage.write_bytes(storage.join(self.url, POINTER), json.dumps(pointer).encode())

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
        storage.write_bytes(self.rank_file(rank), json.dumps(info).encode())

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
