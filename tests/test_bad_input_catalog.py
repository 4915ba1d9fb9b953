"""The bad-input catalog (#16 item 10): one table of a user's mistakes, each run through the
real CLI (`jobs.cli.main`, in this process: no engine may start, so none is paid for),
checked for its exit code, its one line naming what is wrong, and that nothing was
written (the case's folder holds only what the case put there) or lost (the prepared
dataset and any checkpoints are byte-for-byte as before).

README.md's "Bad-input catalog" table is this table: `test_readme_lists_the_catalog`
checks every row is there.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import pytest

from shardline.jobs.cli import main
from shardline.training import checkpoints
from shardline.training.config import TrainingConfig

from .conftest import REPO
from .defaults_helpers import FEATURES, small_dataset, tree  # noqa: F401 (a fixture)


@dataclass
class Case:
    what: str  # the mistake, as the README's table says it
    args: list[str]  # after `shardline`; {cfg} is the case's config file, {dir} its folder
    code: int
    message: str  # a fragment of the one line on stderr
    toml: str = ""  # appended to the base config (a section header, then its settings)
    setup: Callable[[Path, str], object] | None = None  # (case dir, dataset dir) -> context or None


def _others_checkpoints(folder: Path, _dataset: str) -> None:
    cfg = TrainingConfig(hidden=[16], batch_size=64)
    checkpoints.save(str(folder / "ckpt"), 5, {"fingerprint": checkpoints.fingerprint(cfg, "v")}, keep=3)


def _file_as_checkpoint_dir(folder: Path, _dataset: str) -> None:
    (folder / "ckpt").write_text("not a folder")


def _bad_manifest(folder: Path, _dataset: str) -> None:
    (folder / "ds").mkdir()
    (folder / "ds" / "manifest.json").write_text("{not json")


def _hold_dataset(folder: Path, dataset: str):
    from shardline.pipelines.prepare import dataset_lease

    return dataset_lease(dataset)


def _hold_output(folder: Path, _dataset: str):
    from shardline.serving.ledger import output_lease

    return output_lease(str(folder / "out"))


T = ["train", "{cfg}"]
# The user's own model package (tests/usermodels/usernets), found through training.code_paths.
USER = f"code_paths = ['{Path(__file__).parent / 'usermodels' / 'usernets'}']\n"


def _user(what: str, settings: list[str], message: str) -> Case:
    return Case(what, [*T, *(a for s in settings for a in ("--set", s))], 2, message, toml=USER)


CASES = [
    # -- the config file and --set (exit 2)
    Case("config file missing", ["train", "{dir}/nope.toml"], 2, "nope.toml: config file not found"),
    Case("config is not TOML", T, 2, "invalid TOML", toml="[training\n"),
    Case("unknown setting", T, 2, "unknown setting 'training.epochz'", toml="epochz = 3\n"),
    Case("wrong type", T, 2, "training.seed: Input should be a valid integer", toml="seed = 'zero'\n"),
    Case("--set without =", [*T, "--set", "training.epochs"], 2, "expected section.field=value"),
    Case("--set into a value", [*T, "--set", "training.epochs.x=1"], 2, "'epochs' is a value, not a section"),
    Case("world size 0", [*T, "--set", "training.world_size=0"], 2,
         "training.world_size: Input should be greater than or equal to 1"),
    Case("negative learning rate", [*T, "--set", "training.lr=-1"], 2, "training.lr: Input should be greater than 0"),
    Case("unknown launcher in the config", [*T, "--set", "training.launcher='yarn'"], 2,
         "training.launcher: Input should be 'spark', 'dask' or 'local'"),
    Case("a column used twice", [*T, "--set", "pipelines.features.numeric=['a','a']"], 2,
         "column(s) used twice in the feature spec: a"),
    Case("no feature column", [*T, "--set", "pipelines.features.numeric=[]"], 2,
         "the feature spec names no feature column"),
    Case("split fractions off", [*T, "--set", "pipelines.split.val=0.5"], 2, "split fractions must sum to 1"),
    # -- flags (exit 2)
    Case("unknown launcher flag", [*T, "--launcher", "yarn"], 2, "Invalid value for '--launcher'"),
    Case("world size not a number", [*T, "--world-size", "two"], 2, "Invalid value for '--world-size'"),
    Case("--refit without --append", ["prepare", "{cfg}", "--refit"], 2, "--refit goes with --append"),
    Case("score without a model", ["score", "{cfg}"], 2, "no model: pass --model or set serving.model_uri"),
    Case("unknown command", ["trian", "{cfg}"], 2, "No such command 'trian'"),
    Case("benchmark rounds below 1", ["bench", "score", "--rounds", "0"], 2, "Invalid value for '--rounds'"),
    # -- training settings against the dataset (exit 2: a setting at fault)
    Case("unknown model", [*T, "--set", "training.model=resnet"], 2, "unknown model 'resnet'"),
    Case("unknown strategy", [*T, "--set", "training.strategy=zero"], 2, "unknown strategy 'zero'"),
    Case("batch not a multiple of the ranks", [*T, "--set", "training.batch_size=101"], 2,
         "training.batch_size 101 must be a multiple"),
    Case("attention heads do not divide the width",
         [*T, "--set", "training.model=transformer", "--set", "training.hidden=[30]"], 2,
         "must be divisible by training.heads 4"),
    # -- the user's own model, loss and metrics (exit 2, before any engine starts)
    _user("model import path does not import", ["training.model='nosuchpkg.nets:build'"],
          "training.model: cannot import module 'nosuchpkg.nets' (ModuleNotFoundError: No module named 'nosuchpkg')"),
    _user("model is not callable", ["training.model='usernets.nets:NOT_CALLABLE'"],
          "training.model: usernets.nets:NOT_CALLABLE is not callable"),
    _user("model factory returns no nn.Module", ["training.model='usernets.nets:not_a_module'"],
          "returned a dict, not a torch.nn.Module"),
    _user("model_args the factory rejects", ["training.model='usernets.nets:build'", "training.model_args={{depth=0}}"],
          "raised ValueError: depth must be at least 1, got 0"),
    _user("loss with the wrong signature", ["training.model='usernets.nets:build'",
                                            "training.loss='usernets.losses:one_argument'"],
          "training.loss: usernets.losses:one_argument must take (output, target)"),
    _user("strategy needs a plan the model does not declare",
          ["training.model='usernets.nets:plain'", "training.strategy='pipeline'"],
          "is no nn.Sequential and declares no pipeline_layers()"),
    _user("model output width does not match the classes", ["training.model='usernets.nets:wrong_width'"],
          "the output must be [batch, 3]"),
    Case("sweep with nothing to search", ["sweep", "{cfg}"], 2, "sweep.space is empty"),
    Case("sweep objective not logged", ["sweep", "{cfg}", "--set", "sweep.objective='val_f1'"], 2,
         "training does not produce 'val_f1'",
         toml="[sweep.space.lr]\ntype = 'float'\nlow = 0.001\nhigh = 0.1\n"),
    Case("relative path on a cluster", [*T, "--set", "spark.master='spark://10.1.2.3:7077'",
                                        "--set", "training.checkpoint_dir='ckpt'"], 2,
         "training.checkpoint_dir = 'ckpt' is a relative path"),
    # -- the data or a refused run (exit 1)
    Case("default batch over a small dataset (0 steps)", [*T, "--set", "training.batch_size=512"], 1,
         "every epoch would take 0 optimizer steps"),
    Case("more ranks than shards", [*T, "--world-size", "8"], 1, "world size 8 is greater than the 2 shard(s)"),
    Case("no prepared dataset", [*T, "--set", "pipelines.dataset_dir='{dir}/none'"], 1,
         "no manifest; run `shardline prepare` first"),
    Case("manifest is not JSON", [*T, "--set", "pipelines.dataset_dir='{dir}/ds'"], 1, "not valid JSON",
         setup=_bad_manifest),
    Case("plan without a dataset", ["plan", "{cfg}", "--set", "pipelines.dataset_dir='{dir}/none'"], 1,
         "no manifest"),
    Case("resume with no checkpoint", [*T, "--resume"], 1, "no checkpoint to resume from"),
    Case("another job's checkpoints in checkpoint_dir", T, 1,
         "holds another job's checkpoints", setup=_others_checkpoints),
    Case("checkpoint_dir is a file", T, 1, "exists and is not a directory", setup=_file_as_checkpoint_dir),
    # -- MLflow down (exit 1, in seconds: not minutes of retries, never "not found")
    Case("score with MLflow unreachable",
         ["score", "{cfg}", "--model", "models:/m/1", "--output", "{dir}/out", "--engine", "dask",
          "--set", "tracking.tracking_uri='http://127.0.0.1:9'"], 1,
         "tracking.tracking_uri: MLflow at http://127.0.0.1:9 is not reachable"),
    # -- held leases (exit 75)
    Case("prepare while another prepare holds the dataset", ["prepare", "{cfg}", "--engine", "dask"], 75,
         "is in use by", setup=_hold_dataset),
    Case("score into an output another job holds",
         ["score", "{cfg}", "--model", "models:/m/1", "--output", "{dir}/out", "--engine", "dask"], 75,
         "is in use by", setup=_hold_output),
]


def _base(dataset: str, folder: Path) -> str:
    numeric = ", ".join(f"'{c}'" for c in FEATURES["numeric"])
    return (
        f"[pipelines]\ndataset_dir = '{dataset}'\n"
        # The raw files the dataset was prepared from (defaults_helpers: beside the dataset).
        f"[pipelines.source]\nformat = 'parquet'\npath = '{Path(dataset).parent / 'raw'}'\n"
        f"[pipelines.features]\nkey = 'key'\nlabel = 'label'\nnumeric = [{numeric}]\ncategorical = []\n"
        f"[tracking]\ntracking_uri = 'sqlite:///{folder}/mlflow.db'\n"
        f"[training]\nlauncher = 'spark'\nworld_size = 2\nbatch_size = 64\nepochs = 1\n"
        f"checkpoint_dir = '{folder}/ckpt'\n"
    )


@pytest.mark.parametrize("case", CASES, ids=[c.what for c in CASES])
def test_bad_input(case: Case, small_dataset, tmp_path, monkeypatch, capsys):  # noqa: F811
    dataset = small_dataset.dataset_dir
    folder = tmp_path / "case"
    folder.mkdir()
    (folder / "job.toml").write_text(_base(dataset, folder) + case.toml)
    data_before = tree(Path(dataset))
    with ExitStack() as stack:
        held = case.setup(folder, dataset) if case.setup else None
        if held is not None:
            stack.enter_context(held)
        before = tree(folder)
        monkeypatch.chdir(folder)
        args = [a.format(cfg=folder / "job.toml", dir=folder) for a in case.args]
        with pytest.raises(SystemExit) as exit_:
            main(args)
        err = capsys.readouterr().err
        assert exit_.value.code == case.code, err
        lines = [ln for ln in err.strip().splitlines() if ln.strip()]
        # One line (click's usage errors add a "Usage:" and a "Try" line around theirs).
        errors = [ln for ln in lines if not ln.startswith(("Usage:", "Try "))]
        assert len(errors) == 1 and case.message in errors[0], err
        assert tree(folder) == before  # nothing written, nothing lost
    assert tree(Path(dataset)) == data_before


def test_the_catalog_is_large_and_covers_every_exit_code():
    assert len(CASES) >= 30
    assert {c.code for c in CASES} == {1, 2, 75}


def test_readme_lists_the_catalog():
    text = (REPO / "README.md").read_text()
    table = text.split("### Bad-input catalog", 1)[1]
    for c in CASES:
        row = f"| {c.what} | `shardline {c.args[0]}` | {c.code} | {c.message} |"
        assert row in table, row
