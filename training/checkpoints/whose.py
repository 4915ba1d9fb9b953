"""Whose checkpoint folder this is, and whether a resume may continue it: the read-only
checks of a CheckpointStore (training.checkpoints.store), which a driver runs before it
writes, deletes, holds or launches anything. A new job may clear only its own earlier
checkpoints; a resume needs a checkpoint, the same code (unless allowed) and an epoch left.
"""

from __future__ import annotations

from shardline.foundation.code_travel import UserCode
from shardline.foundation.errors import DataError

from .fingerprint import NOT_IN_FOLDER_NAME, SAME_JOB_FIELDS, ResumeRefused, code_refusal, differences, upgraded


class WhoseFolder:
    """The checks, on a store's reads (`owner`, `latest`, `_newest`, `where`, `own`)."""

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
            raise ResumeRefused(f"{self.where}: no checkpoint to resume from")
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
        raise ResumeRefused(
            f"{self.where}: the newest checkpoint ends the job (epoch {epoch} of training.epochs = {epochs} "
            f"done): a resume would train 0 steps; to train further, {more}; to start over, train without --resume"
        )
