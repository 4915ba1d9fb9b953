"""The bad-input catalog and the exit codes: one table each, the source of truth for both
the test that runs every case (tests/test_bad_input_catalog.py, tests/test_defaults.py)
and the reference page generated from them (docs/reference/errors.md, `python
docs/gen_ref.py`). A case added here is run by the test and listed on the page.

Each case is a user's mistake run through the real CLI: its exit code, a fragment of its one
line on stderr, and what it needs in place first (a config addition, a setup).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from shardline.foundation.code_travel import snapshot
from shardline.training.checkpoints import fingerprint
from shardline.training.checkpoints.store import CheckpointStore
from shardline.training.config import TrainingConfig

# The rule the codes follow (#53 item 12), said on the reference page above the table.
EXIT_RULE = (
    "One rule: **2** when what you typed is wrong, on its face or against the checkpoint it "
    "resumes: change the command or the config (a setting, a flag, a `--resume` refused, whatever "
    "it found); **1** when what the run found or met is: the data, the storage, MLflow, another "
    "job's checkpoints, or a failure while running; **75** when another job holds the folder "
    "(try later); **130** when interrupted."
)

# code -> (meaning, the exception classes or click errors that raise it). tests/test_defaults.py
# checks each class's exit_code against this table.
EXIT_CODES: dict[int, tuple[str, str]] = {
    0: ("done", ""),
    1: ("bad data or a refused run: a missing or unreadable input, a dataset that cannot train as "
        "configured (world size over shards, a global batch that gives a rank 0 steps an epoch), a "
        "checkpoint of another job, unreachable storage or MLflow; a rank's failure",
        "`ShardlineError`, `DataError`, `StorageError` (`shardline/foundation/errors.py`), `TrainingFailed`"),
    2: ("a config or usage error: a missing or invalid config file, an unknown setting (in the file or "
        "an override), a wrong type or value, a bad flag; a refused `--resume` (a setting or the code "
        "changed since the checkpoint, no checkpoint, the job already finished, a mesh it cannot reshard to)",
        "`ConfigError`, `ResumeRefused`, click's usage errors"),
    75: ("another job holds the lease of the dataset, checkpoint or output directory: try again later "
         "(EX_TEMPFAIL)", "`LeaseHeld`"),
    130: ("interrupted (Ctrl-C)", ""),
}


@dataclass
class Case:
    what: str  # the mistake, as the reference page says it
    args: list[str]  # after `shardline`; {cfg} is the case's config file, {dir} its folder, {dataset} the dataset's
    code: int
    message: str  # a fragment of the one line on stderr
    toml: str = ""  # appended to the base config (a section header, then its settings)
    setup: Callable[[Path, str], object] | None = None  # (case dir, dataset dir) -> context or None
    usage: bool = False  # click's own usage error: its "Usage:" and "Try" lines come around the one line
    env: dict[str, str] | None = None  # environment variables the case sets (the S3 clients are made anew)


def _others_checkpoints(folder: Path, _dataset: str) -> None:
    cfg = TrainingConfig(hidden=[16], batch_size=64)
    CheckpointStore(str(folder / "ckpt")).save(5, {"fingerprint": fingerprint.fingerprint(cfg, "v")}, keep=3)


def _checkpoint_of_other_code(folder: Path, _dataset: str) -> None:
    """A checkpoint of this config written by other code: usernets/nets.py as it was then."""
    from shardline.foundation.code_travel import code_digest

    files = {**snapshot([str(USERNETS)]).files, "usernets/nets.py": "0" * 64}
    fp = {**fingerprint.fingerprint(TrainingConfig(), "v"), "code": code_digest(files)}
    CheckpointStore(str(folder / "ckpt")).save(5, {"fingerprint": fp, "code_files": files, "epoch": 0}, keep=3)


def _own_checkpoints(folder: Path, _dataset: str) -> None:
    """This very job's earlier checkpoints (the base config's training settings): a new run
    would start over there, replacing them, if nothing refused it first."""
    cfg = TrainingConfig(launcher="spark", world_size=2, batch_size=64, epochs=1)
    fp = fingerprint.fingerprint(cfg, "v", snapshot([]))
    CheckpointStore(str(folder / "ckpt")).save(5, {"fingerprint": fp, "epoch": 1}, keep=3)


def _checkpoint_of_another_lr(folder: Path, dataset: str) -> None:
    """This job's checkpoint (the base config's training settings, on the dataset as it is),
    written with another learning rate, its job not finished."""
    from shardline.pipelines.manifest import load_manifest

    cfg = TrainingConfig(launcher="spark", world_size=2, batch_size=64, epochs=1, lr=0.5)
    fp = fingerprint.fingerprint(cfg, load_manifest(dataset).version_id, snapshot([]))
    CheckpointStore(str(folder / "ckpt")).save(5, {"fingerprint": fp, "epoch": 0, "global_step": 5}, keep=3)


def _file_as_checkpoint_dir(folder: Path, _dataset: str) -> None:
    (folder / "ckpt").write_text("not a folder")


def _bad_manifest(folder: Path, _dataset: str) -> None:
    (folder / "ds").mkdir()
    (folder / "ds" / "manifest.json").write_text("{not json")


def _loose_images(folder: Path, _dataset: str) -> None:
    (folder / "imgs").mkdir()
    (folder / "imgs" / "a.png").write_bytes(b"\x89PNG")  # no class folder around it


def _class_folder(folder: Path, _dataset: str) -> None:
    (folder / "imgs" / "cat").mkdir(parents=True)
    (folder / "imgs" / "cat" / "a.png").write_bytes(b"\x89PNG")


def _one_image(data: bytes):
    def setup(folder: Path, _dataset: str) -> None:
        (folder / "imgs" / "cat").mkdir(parents=True)
        (folder / "imgs" / "cat" / "a.jpg").write_bytes(data)
    return setup


def _jpeg(height: int, width: int) -> bytes:
    import io

    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (width, height), (200, 30, 90)).save(buf, "JPEG")
    return buf.getvalue()


def _tensor_rows(grid, tokens):
    """A Parquet input whose first row holds `grid` (declared uint8 [2, 3]) and `tokens`
    (int32 [4], vocab_size 10), the next rows good ones: the first file's first rows are
    checked before an engine starts."""
    def setup(folder: Path, _dataset: str) -> None:
        import pyarrow as pa
        import pyarrow.parquet as pq

        (folder / "tensors").mkdir()
        pq.write_table(pa.table({"key": [1, 2, 3], "label": [0, 1, 0],
                                 "grid": [grid, [[1, 2, 3], [4, 5, 6]], [[0, 0, 0], [0, 0, 0]]],
                                 "tokens": [tokens, [1, 2, 3, 4], [5, 6, 7, 8]]}), folder / "tensors" / "part-0.parquet")
    return setup


def _folder_named_shardline(folder: Path, _dataset: str) -> None:
    (folder / "shardline").mkdir()
    (folder / "shardline" / "mynets.py").write_text("def build(inputs):\n    raise AssertionError('never imported')\n")


def _small_csv(folder: Path, _dataset: str) -> None:
    """442 rows (a classic small table) as CSV, the catalog's columns."""
    (folder / "raw442").mkdir()
    rows = "".join(f"{k},{k % 7 * 0.5},{k % 5 - 2.0},{k % 3 * 1.5},{k % 3}\n" for k in range(442))
    (folder / "raw442" / "part-0.csv").write_text("key,a,b,c,label\n" + rows)


def _many_csv_one_without_a_column(folder: Path, _dataset: str) -> None:
    """500 small CSV files of the catalog's columns; the middle one lacks column c (the
    shape of 100,000 small files, at a count a test can write)."""
    (folder / "many").mkdir()
    for i in range(500):
        cols = "key,a,b,label" if i == 250 else "key,a,b,c,label"
        row = f"{i},0.5,1.5,{i % 3}" if i == 250 else f"{i},0.5,1.5,2.5,{i % 3}"
        (folder / "many" / f"part-{i:05d}.csv").write_text(f"{cols}\n{row}\n")


def _hold_dataset(folder: Path, dataset: str):
    from shardline.pipelines.prepare import dataset_lease

    return dataset_lease(dataset)


def _store_with_model_m(folder: Path) -> None:
    """The case's MLflow store (folder/mlflow.db, the base config's) holding registered model
    `m` version 1, a pyfunc model (its MLmodel file alone: what scoring checks before it runs)."""
    import logging

    from mlflow.tracking import MlflowClient

    from .mlflow_store import empty_store

    # The template store, made once per process, is MLflow's: its INFO lines are not the case's.
    quiet = logging.getLogger("mlflow.store.db.utils")
    level = quiet.level
    quiet.setLevel(logging.WARNING)
    try:
        db = empty_store(folder)
    finally:
        quiet.setLevel(level)
    (folder / "model").mkdir()
    (folder / "model" / "MLmodel").write_text("flavors:\n  python_function:\n    loader_module: shardline\n")
    client = MlflowClient(f"sqlite:///{db}")
    client.create_registered_model("m")
    client.create_model_version("m", str(folder / "model"))


def _hold_output(folder: Path, _dataset: str):
    """Another job scoring into folder/out, of a model the case's store has (a refusal of the
    model would come first: the lease is taken last)."""
    from shardline.serving.ledger import output_lease

    _store_with_model_m(folder)
    return output_lease(str(folder / "out"))


def _expired_output_lease(folder: Path, _dataset: str) -> None:
    """folder/out/_lease.json of a job on another host that stopped renewing it an hour ago:
    any job may take it over, and a job refused before it scores must not."""
    import json
    import time

    _store_with_model_m(folder)
    (folder / "out").mkdir()
    (folder / "out" / "_lease.json").write_text(json.dumps({
        "job": "shardline score", "host": "elsewhere", "pid": 4242, "since": "2026-01-01T00:00:00+00:00",
        "expires_at": time.time() - 3600, "nonce": "0123456789abcdef",
    }))


def _other_models_scores(folder: Path, _dataset: str) -> None:
    """An output holding a committed unit of model someone-else, version 7."""
    import json

    version = folder / "out" / "model=someone-else" / "version=7"
    (version / "_ledger").mkdir(parents=True)
    (version / "scores-0123456789abcdef.parquet").write_bytes(b"PAR1")
    (version / "_ledger" / "0123456789abcdef.json").write_text(json.dumps({
        "unit": "/elsewhere/x.parquet", "unit_id": "0123456789abcdef", "fingerprint": "f",
        "output": "scores-0123456789abcdef.parquet", "rows": 5, "model_name": "someone-else",
        "model_version": "7", "model_uri": "models:/someone-else/7", "scored_at": "2026-01-01T00:00:00+00:00",
    }))


T = ["train", "{cfg}"]
P = ["prepare", "{cfg}", "--engine", "dask"]
IMAGES = [*P, "--set", "pipelines.source.format='images'", "--set", "pipelines.source.path='{dir}/imgs'"]
# An images source with its image column declared 3 x 8 x 8 (the base config's numeric columns dropped).
IMAGE_8 = "[pipelines.features.images.image]\nshape = [3, 8, 8]\n"
DECLARED = [*IMAGES, "--set", "pipelines.features.numeric=[]"]
# A Parquet input of tensor columns (_tensor_rows), the base config's numeric columns dropped.
TENSORS = [*P, "--set", "pipelines.source.path='{dir}/tensors'", "--set", "pipelines.features.numeric=[]"]
TENSORS_TOML = ("[pipelines.features.tensors.grid]\ndtype = 'uint8'\nshape = [2, 3]\n"
                "[pipelines.features.tensors.tokens]\ndtype = 'int32'\nshape = [4]\nvocab_size = 10\n")
GOOD_GRID, GOOD_TOKENS = [[1, 2, 3], [4, 5, 6]], [1, 2, 3, 4]
# The user's own model package (tests/usermodels/usernets), found through training.code_paths.
USERNETS = Path(__file__).parent / "usermodels" / "usernets"
USER = f"code_paths = ['{USERNETS}']\n"


DELTA = [*P, "--set", "pipelines.source.format='delta'", "--set", "pipelines.source.path='{dir}/delta'"]
ICEBERG = [*P, "--set", "pipelines.source.format='iceberg'", "--set", "pipelines.source.table='shop.orders'"]


def _delta_table(folder: Path, _dataset: str) -> None:
    import pyarrow as pa
    from deltalake import write_deltalake

    write_deltalake(str(folder / "delta"), pa.table({"key": [1, 2], "label": [0, 1], "x0": [0.5, 1.5]}))


def _delta_table_without_label(folder: Path, _dataset: str) -> None:
    import pyarrow as pa
    from deltalake import write_deltalake

    write_deltalake(str(folder / "delta"), pa.table({"key": [1, 2], "x0": [0.5, 1.5]}))


def _iceberg_table(folder: Path, _dataset: str) -> None:
    import pyarrow as pa
    from pyiceberg.catalog.sql import SqlCatalog

    cat = SqlCatalog("default", uri=f"sqlite:///{folder}/catalog.db", warehouse=f"file://{folder}/warehouse")
    cat.create_namespace("shop")
    cat.create_table("shop.orders", schema=pa.schema([("key", pa.int64()), ("label", pa.int64())])).append(
        pa.table({"key": [1, 2], "label": [0, 1]}))


def _user(what: str, settings: list[str], message: str) -> Case:
    return Case(what, [*T, *(a for s in settings for a in ("--set", s))], 2, message, toml=USER)


# The user's own training loops (tests/usermodels/userloops).
USERLOOPS = Path(__file__).parent / "usermodels" / "userloops"


def _loop(what: str, loop: str, message: str) -> Case:
    return Case(what, [*T, "--set", f"training.loop='{loop}'"], 2, message, toml=f"code_paths = ['{USERLOOPS}']\n")


CASES = [
    # -- the config file and --set (exit 2)
    Case("config file missing", ["train", "{dir}/nope.toml"], 2, "nope.toml: config file not found"),
    Case("config is not TOML", T, 2, "invalid TOML", toml="[training\n"),
    Case("unknown setting", T, 2, "unknown setting 'training.epochz'", toml="epochz = 3\n"),
    Case("unknown setting given with --set (blamed on the --set, not the file)", [*T, "--set", "training.epochz=3"], 2,
         "error: --set training.epochz=3: unknown setting 'training.epochz'"),
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
    Case("an empty label name", [*T, "--set", "pipelines.features.label=''"], 2,
         "pipelines.features.label: a column name cannot be empty (got '')"),
    Case("split fractions off", [*T, "--set", "pipelines.split.val=0.5"], 2, "split fractions must sum to 1"),
    # -- folders inside one another (#53 item 2): refused before anything starts (exit 2)
    Case("a score output inside the dataset",
         ["score", "{cfg}", "--model", "models:/m/1", "--engine", "dask", "--output", "{dataset}/out"], 2,
         "serving.output_dir is inside pipelines.dataset_dir"),
    Case("a checkpoint folder inside the dataset", [*T, "--set", "training.checkpoint_dir='{dataset}/ckpt'"], 2,
         "training.checkpoint_dir is inside pipelines.dataset_dir"),
    Case("a dataset inside the raw source", [*P, "--set", "pipelines.dataset_dir='{dir}/raw/ds'",
                                             "--set", "pipelines.source.path='{dir}/raw'"], 2,
         "pipelines.dataset_dir is inside pipelines.source.path"),
    Case("a raw source (a glob) inside the dataset", [*P, "--set", "pipelines.source.path='{dataset}/train/*.parquet'"], 2,
         "pipelines.source.path is inside pipelines.dataset_dir"),
    Case("a score input holding the output", ["score", "{cfg}", "--model", "models:/m/1", "--engine", "dask",
                                              "--input", "{dir}/raw", "--output", "{dir}/raw/scores"], 2,
         "serving.output_dir is inside --input"),
    Case("checkpoints and scores in one folder (run)", ["run", "{cfg}", "--set", "serving.output_dir='{dir}/ckpt'"], 2,
         "training.checkpoint_dir and serving.output_dir are the same folder"),
    Case("a checkpoint folder inside the dataset, on S3", [*T, "--set", "pipelines.dataset_dir='s3://bucket/ds'",
                                                          "--set", "training.checkpoint_dir='s3://bucket/ds/ckpt'"], 2,
         "training.checkpoint_dir is inside pipelines.dataset_dir ('s3://bucket/ds/ckpt' in 's3://bucket/ds')"),
    # -- accepted, then refused further on: the setting reached the check that needs it
    Case("a Delta timestamp as a TOML datetime (unquoted), before the table's first version",
         [*DELTA, "--set", "pipelines.source.timestamp=2020-01-01T00:00:00Z"], 2,
         "pipelines.source.timestamp = '2020-01-01T00:00:00+00:00': no version of the table was current then",
         setup=_delta_table),
    Case("a Dask scheduler on loopback: no note that other hosts must see the paths, nor a relative "
         "path refused (its workers share this machine's); a missing source is the one line",
         [*P, "--set", "dask.address='tcp://127.0.0.1:9'", "--set", "pipelines.source.path='none'"], 1,
         "case/none: input not found"),
    Case("tensor shape with a zero dimension", P, 2, "shape [0]: every dimension must be >= 1",
         toml="[pipelines.features.tensors.tokens]\ndtype = 'int32'\nshape = [0]\n"),
    Case("unknown tensor dtype", P, 2, "pipelines.features.tensors.tokens.dtype: Input should be 'uint8'",
         toml="[pipelines.features.tensors.tokens]\ndtype = 'float64'\nshape = [8]\n"),
    Case("next_token with a label that is no tensor column", [*P, "--set", "pipelines.features.task='next_token'"], 2,
         "task = 'next_token': label 'label' must name a column of pipelines.features.tensors"),
    Case("next_token without a token tensor with a vocab_size",
         [*P, "--set", "pipelines.features.task='next_token'", "--set", "pipelines.features.label='tokens'"], 2,
         "task = 'next_token': tensor 'tokens' must be a 1-D integer tensor with a vocab_size",
         toml="[pipelines.features.tensors.tokens]\ndtype = 'int32'\nshape = [8]\n"),
    Case("images source without an image column", IMAGES, 2, "declare the image column of the images source",
         setup=_class_folder),
    # -- tables as the input (#47): refused before an engine starts (exit 2)
    Case("a Delta source that is not a Delta table", [*DELTA, "--set", "pipelines.source.path='{dir}'"], 2,
         "not a Delta table (no _delta_log folder in it)"),
    Case("an unknown Delta version", [*DELTA, "--set", "pipelines.source.version=7"], 2,
         "pipelines.source.version = 7: no such version (the table's latest is 0", setup=_delta_table),
    Case("a Delta version and timestamp both", [*DELTA, "--set", "pipelines.source.version=0", "--set",
         "pipelines.source.timestamp='2026-01-01'"], 2, "version and timestamp both pin the Delta table's version"),
    Case("a Delta table without the label column", DELTA, 2, "column 'label' not found (the table's columns: key, x0)",
         setup=_delta_table_without_label),
    Case("an Iceberg catalog that cannot be reached", [*ICEBERG, "--set",
         "pipelines.source.catalog={{type='rest', uri='http://127.0.0.1:9'}}"], 2,
         "pipelines.source.catalog: cannot open the Iceberg catalog"),
    Case("an unknown Iceberg snapshot", [*ICEBERG, "--set", "pipelines.source.catalog={{type='sql', "
         "uri='sqlite:///{dir}/catalog.db', warehouse='file://{dir}/warehouse'}}", "--set",
         "pipelines.source.snapshot_id=5"], 2, "pipelines.source.snapshot_id = 5: no such snapshot",
         setup=_iceberg_table),
    Case("a Spark table source on Dask", [*P, "--set", "pipelines.source.format='table'", "--set",
         "pipelines.source.table='events'"], 2, "needs pipelines.engine = 'spark'"),
    # -- flags (exit 2)
    Case("unknown launcher flag", [*T, "--launcher", "yarn"], 2, "Invalid value for '--launcher'", usage=True),
    Case("world size not a number", [*T, "--world-size", "two"], 2, "Invalid value for '--world-size'", usage=True),
    Case("--refit without --append", ["prepare", "{cfg}", "--refit"], 2, "--refit goes with --append", usage=True),
    Case("score without a model", ["score", "{cfg}"], 2, "no model: pass --model or set serving.model_uri",
         usage=True),
    Case("unknown command", ["trian", "{cfg}"], 2, "No such command 'trian'", usage=True),
    Case("--json-file in a folder that does not exist", [*T, "--json-file", "{dir}/none/result.json"], 2,
         "none/result.json: no folder"),
    Case("benchmark rounds below 1", ["bench", "score", "--rounds", "0"], 2, "Invalid value for '--rounds'",
         usage=True),
    # -- training settings against the dataset (exit 2: a setting at fault)
    Case("unknown model", [*T, "--set", "training.model=resnet"], 2, "unknown model 'resnet'"),
    Case("unknown strategy", [*T, "--set", "training.strategy=zero"], 2, "unknown strategy 'zero'"),
    Case("a setting given by its earlier name and by its name now, with different values",
         [*T, "--set", "training.micro_batches=8", "--set", "training.pipeline.micro_batches=2"], 2,
         "training.micro_batches = 8 and training.pipeline.micro_batches = 2 are one setting (training.pipeline"
         ".micro_batches) given twice"),
    # -- the device mesh (exit 2, before any engine starts)
    Case("a mesh whose product is not the world size",
         [*T, "--set", "training.mesh.dp_shard=2", "--set", "training.mesh.tp=2"], 2,
         "training.mesh dp_shard 2 x tp 2 = 4 must divide training.world_size 2"),
    Case("a tensor-parallel degree that does not divide the model's heads",
         [*T, "--set", "training.model=transformer", "--set", "training.hidden=[24]", "--set", "training.heads=4",
          "--set", "training.world_size=3", "--set", "training.batch_size=63", "--set", "training.mesh.tp=3"], 2,
         "training.mesh.tp 3 must divide training.heads 4 (and d_model 24)"),
    Case("a tensor-parallel degree that does not divide a layer's width",
         [*T, "--set", "training.hidden=[15, 8]", "--set", "training.mesh.tp=2"], 2,
         "training.mesh.tp 2 must divide training.hidden[0] 15"),
    Case("more pipeline stages than the model declares",
         [*T, "--set", "training.hidden=[16]", "--set", "training.world_size=4", "--set", "training.mesh.pp=4"], 2,
         "training.mesh.pp 4: more pipeline stages than the model's 3 layers"),
    Case("batch not a multiple of the ranks", [*T, "--set", "training.batch_size=101"], 2,
         "training.batch_size 101 must be a multiple"),
    Case("the language model on a dataset of another task", [*T, "--set", "training.model=decoder"], 2,
         "training.model decoder is a language model: it needs pipelines.features.task = 'next_token'"),
    Case("attention heads do not divide the width",
         [*T, "--set", "training.model=transformer", "--set", "training.hidden=[30]"], 2,
         "must be divisible by training.heads 4"),
    # -- the user's own model, loss and metrics (exit 2, before any engine starts)
    _user("model import path does not import", ["training.model='nosuchpkg.nets:build'"],
          "training.model: cannot import module 'nosuchpkg.nets' (ModuleNotFoundError: No module named 'nosuchpkg')"),
    Case("model in a folder of the user's named shardline", [*T, "--set", "training.model='shardline.mynets:build'"],
         2, "cannot import module 'shardline.mynets': the name 'shardline' is taken by shardline itself",
         setup=_folder_named_shardline),
    _user("model is not callable", ["training.model='usernets.nets:NOT_CALLABLE'"],
          "training.model: usernets.nets:NOT_CALLABLE is not callable"),
    _user("model factory returns no nn.Module", ["training.model='usernets.nets:not_a_module'"],
          "returned a dict, not a torch.nn.Module"),
    _user("model_args the factory rejects", ["training.model='usernets.nets:build'", "training.model_args={{depth=0}}"],
          "raised ValueError: depth must be at least 1, got 0"),
    _loop("loop import path does not import", "userloops.nope:loop",
          "training.loop: cannot import module 'userloops.nope' (ModuleNotFoundError"),
    _loop("loop that does not take one argument", "userloops.loops:takes_two",
          "training.loop: userloops.loops:takes_two(ctx, extra) must take exactly one positional argument, "
          "the loop context"),
    _user("loss with the wrong signature", ["training.model='usernets.nets:build'",
                                            "training.loss='usernets.losses:one_argument'"],
          "training.loss: usernets.losses:one_argument must take (output, target)"),
    _user("strategy needs a plan the model does not declare",
          ["training.model='usernets.nets:plain'", "training.strategy='pipeline'"],
          "is no nn.Sequential and declares no pipeline_layers()"),
    _user("model output width does not match the classes", ["training.model='usernets.nets:wrong_width'"],
          "the output must be [batch, 3]"),
    # -- a refused --resume (exit 2, #53 item 12: whatever the checkpoint refuses it for)
    Case("resume over changed code", [*T, "--resume", "--set", "training.model='usernets.nets:build'"], 2,
         "the code changed since the checkpoint: usernets/nets.py changed; to resume with it: --allow-changed code",
         toml=USER, setup=_checkpoint_of_other_code),
    Case("resume with a changed setting", [*T, "--resume"], 2,
         "checkpoint is from a different run: lr='0.5' (config has '0.003')", setup=_checkpoint_of_another_lr),
    Case("resume with no checkpoint", [*T, "--resume"], 2, "no checkpoint to resume from"),
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
    Case("`run` with a batch the source's rows cannot give a step (before prepare)",
         ["run", "{cfg}", "--set", "pipelines.source.format='csv'", "--set", "pipelines.source.path='{dir}/raw442'",
          "--set", "pipelines.dataset_dir='{dir}/ds442'", "--set", "training.batch_size=512"], 1,
         "the source's 442 rows give each rank about 177 train rows (pipelines.split.train = 0.8): every "
         "epoch would take 0 optimizer steps and the model would not train; set training.batch_size to at most",
         setup=_small_csv),
    Case("no prepared dataset", [*T, "--set", "pipelines.dataset_dir='{dir}/none'"], 1,
         "no manifest; run `shardline prepare` first"),
    Case("manifest is not JSON", [*T, "--set", "pipelines.dataset_dir='{dir}/ds'"], 1, "not valid JSON",
         setup=_bad_manifest),
    Case("a forecast for hosts without cores", ["plan", "{cfg}", "--hosts", "2"], 2,
         "--hosts and --cores go together", usage=True),
    Case("plan without a dataset", ["plan", "{cfg}", "--set", "pipelines.dataset_dir='{dir}/none'"], 1,
         "no manifest"),
    Case("plan on a dataset too small to time the loader (3 batches an epoch)", ["plan", "{cfg}"], 1,
         "the loader's rate cannot be measured: rank 0 of 2 reads"),
    Case("one file among many without a named column",
         [*P, "--set", "pipelines.source.format='csv'", "--set", "pipelines.source.path='{dir}/many'",
          "--set", "pipelines.dataset_dir='{dir}/ds-many'"], 1,
         "many/part-00250.csv: column 'c' not found (have: key, a, b, label)", setup=_many_csv_one_without_a_column),
    Case("a tensor column that is missing", P, 1, "column 'tokens' not found",
         toml="[pipelines.features.tensors.tokens]\ndtype = 'int32'\nshape = [8]\n"),
    Case("a tensor of another shape than declared", TENSORS, 1,
         "column 'grid', key 1: value '[[1, 2], [3, 4]]': tensor's shape differs from the declared [2, 3]",
         toml=TENSORS_TOML, setup=_tensor_rows([[1, 2], [3, 4]], GOOD_TOKENS)),
    Case("a tensor whose values do not fit the declared dtype", TENSORS, 1,
         "column 'grid', key 1: value '[[1, 2, 300], [4, 5, 6]]': tensor's values do not fit the declared dtype uint8",
         toml=TENSORS_TOML, setup=_tensor_rows([[1, 2, 300], [4, 5, 6]], GOOD_TOKENS)),
    Case("a token id at or above the declared vocabulary size", TENSORS, 1,
         "column 'tokens', key 1: value '[1, 2, 10, 4]': token id outside the vocabulary 0..9 (vocab_size = 10)",
         toml=TENSORS_TOML, setup=_tensor_rows(GOOD_GRID, [1, 2, 10, 4])),
    Case("images folder with no class subfolders", IMAGES, 1, "no class folders with images", setup=_loose_images),
    Case("an undecodable image", DECLARED, 1,
         "not a decodable PNG or JPEG image", toml=IMAGE_8, setup=_one_image(_jpeg(8, 8)[:-200])),
    Case("an image of another size when no resize is configured", DECLARED, 1,
         "image is not 8x8 (height x width) and pipelines.features.images.image.resize is off",
         toml=IMAGE_8, setup=_one_image(_jpeg(8, 9))),
    Case("another job's checkpoints in checkpoint_dir", T, 1,
         "holds another job's checkpoints", setup=_others_checkpoints),
    Case("checkpoint_dir is a file", T, 1, "exists and is not a directory", setup=_file_as_checkpoint_dir),
    Case("checkpoint_dir under a file", [*T, "--set", "training.checkpoint_dir='{dir}/ckpt/job'"], 1,
         "/ckpt is a file, not a directory", setup=_file_as_checkpoint_dir),
    # -- MLflow down (exit 1, in seconds: not minutes of retries, never "not found")
    Case("score with MLflow unreachable",
         ["score", "{cfg}", "--model", "models:/m/1", "--output", "{dir}/out", "--engine", "dask",
          "--set", "tracking.tracking_uri='http://127.0.0.1:9'"], 1,
         "tracking.tracking_uri: MLflow at http://127.0.0.1:9 is not reachable"),
    # A refused run loses nothing: the store is checked before the folder is started over
    # (its earlier run's checkpoints stay) and before `run` prepares a dataset version.
    Case("train over this job's own checkpoints with MLflow unreachable",
         [*T, "--set", "tracking.tracking_uri='http://127.0.0.1:9'"], 1,
         "tracking.tracking_uri: MLflow at http://127.0.0.1:9 is not reachable", setup=_own_checkpoints),
    Case("train with an MLflow database store whose driver is not installed",
         [*T, "--set", "tracking.tracking_uri='postgresql://u:secret@127.0.0.1:1/mlflow'"], 1,
         "MLflow's postgresql store needs a database driver that is not installed", setup=_own_checkpoints),
    Case("run with an MLflow database store whose driver is not installed",
         ["run", "{cfg}", "--set", "tracking.tracking_uri='postgresql://u:secret@127.0.0.1:1/mlflow'"], 1,
         "MLflow's postgresql store needs a database driver that is not installed"),
    Case("score with an MLflow database store whose driver is not installed",
         ["score", "{cfg}", "--model", "models:/m/1", "--output", "{dir}/out", "--engine", "dask",
          "--set", "tracking.tracking_uri='postgresql://u:secret@127.0.0.1:1/mlflow'"], 1,
         "MLflow's postgresql store needs a database driver that is not installed"),
    Case("the UI on an MLflow database store whose driver is not installed (before its server)",
         ["ui", "{cfg}", "--set", "tracking.tracking_uri='postgresql://u:secret@127.0.0.1:1/mlflow'"], 1,
         "MLflow's postgresql store needs a database driver that is not installed"),
    # -- the S3 endpoint with a user part (#53 item 5): one line, the token masked (the test
    # checks that "secret" is in no line), before any read: nothing listens on port 9
    Case("prepare with AWS_ENDPOINT_URL=http://TOKEN@host:port",
         [*P, "--set", "pipelines.dataset_dir='s3://bucket/ds'"], 1,
         "the S3 endpoint http://***@127.0.0.1:9 (AWS_ENDPOINT_URL) has a user part (user@host)",
         env={"AWS_ENDPOINT_URL": "http://secret-token@127.0.0.1:9"}),
    Case("score with AWS_ENDPOINT_URL=http://TOKEN@host:port",
         ["score", "{cfg}", "--model", "models:/m/1", "--engine", "dask", "--output", "s3://bucket/scores"], 1,
         "serving.output_dir: s3://bucket/scores: the S3 endpoint http://***@127.0.0.1:9 (AWS_ENDPOINT_URL) has a "
         "user part", env={"AWS_ENDPOINT_URL": "http://secret-token@127.0.0.1:9"}),
    # -- an output of another model (exit 1; score refuses it the same way)
    Case("run into an output holding another model's scores (before it prepares)",
         ["run", "{cfg}", "--set", "serving.output_dir='{dir}/out'", "--set", "pipelines.engine='dask'"], 1,
         "holds scores of model someone-else (version 7), not of shardline-model; choose another output "
         "directory or pass --force to discard them", setup=_other_models_scores),
    # -- held leases (exit 75)
    Case("prepare while another prepare holds the dataset", ["prepare", "{cfg}", "--engine", "dask"], 75,
         "is in use by", setup=_hold_dataset),
    Case("score into an output another job holds",
         ["score", "{cfg}", "--model", "models:/m/1", "--output", "{dir}/out", "--engine", "dask"], 75,
         "is in use by", setup=_hold_output),
    # -- the model refused before the output's lease is taken (#53 item 4): the lease untouched
    Case("score a model version that does not exist, an expired lease in the output",
         ["score", "{cfg}", "--model", "models:/m/99", "--output", "{dir}/out", "--engine", "dask"], 1,
         "model models:/m/99: 'm' has no version 99", setup=_expired_output_lease),
    Case("score from a SQLite MLflow store that does not exist (not created)",
         ["score", "{cfg}", "--model", "models:/m/1", "--output", "{dir}/out", "--engine", "dask"], 1,
         "(the file does not exist), so no model is registered there"),
]

