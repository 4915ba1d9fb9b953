"""One TOML file plus `--set section.field=value` overrides, composed from each package's own section."""

from __future__ import annotations

import copy
import os
import tomllib
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from pydantic import Field, ValidationError

from shardline.foundation.engine_config import DaskConfig, SparkConfig
from shardline.foundation.section import Section
from shardline.pipelines.config import PipelineConfig
from shardline.engines import engine_class, given_engines
from shardline.foundation import report
from shardline.foundation.errors import ConfigError
from shardline.foundation.overlap import check_apart, glob_base
from shardline.foundation.storage import is_remote, resolve, check_access
from shardline.serving.config import ServingConfig
from shardline.training.checkpoints.store import CheckpointStore
from shardline.training.config import TrackingConfig, TrainingConfig
from shardline.training.strategy_settings import renamed, renamed_path
from shardline.training.sweeps.config import SweepConfig


class ShardlineConfig(Section):
    spark: SparkConfig = Field(default_factory=SparkConfig)
    dask: DaskConfig = Field(default_factory=DaskConfig)
    pipelines: PipelineConfig = Field(default_factory=PipelineConfig)
    training: TrainingConfig = Field(default_factory=TrainingConfig)
    tracking: TrackingConfig = Field(default_factory=TrackingConfig)
    serving: ServingConfig = Field(default_factory=ServingConfig)
    sweep: SweepConfig = Field(default_factory=SweepConfig)


def load_config(
    source: str | Path | ShardlineConfig | Mapping | None,
    overrides: Iterable[str] | Mapping[str, Any] = (),
) -> ShardlineConfig:
    """Read, override, validate. Every failure is one ConfigError naming file and field.

    source: a TOML file, a config object (its settings as written: fields left unset stay
    unset, so "not written" still means "default"), a dict of sections, or None (defaults).
    overrides: `section.field=value` strings as `--set` takes them (the value is TOML), or
    a mapping {"section.field": value} of Python values.
    """
    where = "defaults"
    data: dict = {}
    if isinstance(source, ShardlineConfig):
        where, data = "config", source.model_dump(exclude_unset=True)
    elif isinstance(source, Mapping):
        where, data = "config", copy.deepcopy(dict(source))
    elif source is not None:
        p = Path(source)
        where = str(source)
        if not p.is_file():
            raise ConfigError(f"{p}: config file not found")
        try:
            data = tomllib.loads(p.read_text())
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"{p}: invalid TOML: {e}") from None
        except UnicodeDecodeError:
            raise ConfigError(f"{p}: config file is not UTF-8 text") from None
    # A setting's earlier name (training.tp, training.micro_batches) is read as its name now
    # (training.mesh.tp, training.pipeline.micro_batches), one line saying so: one path in the
    # data, so an override replaces the source's whichever name each used.
    # Said once the config is good: a refused one gets its one line only.
    said: list[str] = []
    data, seen = _renamed_source(data, where, said), {}
    given: dict[str, str] = {}  # path -> the override that set it, which a mistake there is blamed on
    if isinstance(overrides, Mapping):
        for key, value in overrides.items():
            path = _override_path(str(key).strip(), value, seen, said)
            _set(data, path, value, f"{key}={value!r}")
            given[path] = f"overrides[{str(key).strip()!r}]"
    else:
        for item in overrides:
            given[_apply_override(data, item, seen, said)] = f"--set {item.strip()}"
    try:
        cfg = ShardlineConfig.model_validate(data)
    except ValidationError as e:
        err = e.errors()[0]
        field = ".".join(str(x) for x in err["loc"])
        blamed = _blamed(field, given, where)
        if err["type"] == "extra_forbidden":
            raise ConfigError(f"{blamed}: unknown setting '{field}'") from None
        scalar = isinstance(err.get("input"), (str, int, float, bool))
        got = f" (got {err['input']!r})" if scalar else ""
        msg = err["msg"].removeprefix("Value error, ")
        raise ConfigError(f"{blamed}: {field}: {msg}{got}") from None
    for text in said:
        report.warn(text)
    return cfg


def _blamed(field: str, given: dict[str, str], where: str) -> str:
    """Who wrote the setting at fault: the override that set it or a section around it
    (`--set 'training={epochz=3}'`), else the file (or "config", "defaults")."""
    for path, override in reversed(given.items()):  # the last override of a setting wins
        if field == path or field.startswith(path + "."):
            return override
    return where


def _apply_override(data: dict, item: str, seen: dict, said: list[str]) -> str:
    """Apply one `--set section.field=value`; returns the path it set."""
    key, sep, raw = item.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"--set {item!r}: expected section.field=value")
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw  # a bare word is a string: --set training.model=mlp
    path = _override_path(key.strip(), value, seen, said)
    _set(data, path, value, item)
    return path


def _renamed_source(data: dict, where: str, said: list[str]) -> dict:
    """The source's training settings and searched sweep settings under their names now."""
    if isinstance(data.get("training"), dict):
        try:
            training, lines = renamed(data["training"])
        except ConfigError as e:
            raise ConfigError(f"{where}: {e}") from None
        data = {**data, "training": training}
        said += [f"{where}: {text}" for text in lines]
    space = data.get("sweep", {}).get("space") if isinstance(data.get("sweep"), dict) else None
    if isinstance(space, dict) and any(renamed_path(k) != k for k in space):
        for k in [k for k in space if renamed_path(k) != k]:
            said.append(f"{where}: sweep.space.{k} searches training.{renamed_path(k)}: read as "
                        f'sweep.space."{renamed_path(k)}" (rename it in your config)')
        data = {**data, "sweep": {**data["sweep"], "space": {renamed_path(k): v for k, v in space.items()}}}
    return data


def _override_path(key: str, value: Any, seen: dict[str, tuple[str, Any]], said: list[str]) -> str:
    """The path an override sets, an earlier name's its name now (one line saying so).
    seen: the overrides so far (path -> (key, value)); one setting overridden by both its
    names with different values is refused."""
    section, _, name = key.partition(".")
    path = key
    if section == "training" and renamed_path(name) != name:
        path = f"training.{renamed_path(name)}"
        said.append(f"{key} is now {path}: read as that (rename it)")
    earlier = seen.get(path)
    if earlier is not None and earlier[0] != key and earlier[1] != value:
        raise ConfigError(
            f"{earlier[0]} = {earlier[1]!r} and {key} = {value!r} are one setting ({path}) given twice "
            f"with different values: give {path} only"
        )
    seen[path] = (key, value)
    return path


def _set(data: dict, key: str, value: Any, item: str) -> None:
    *parents, leaf = key.strip().split(".")
    node = data
    for part in parents:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"--set {item!r}: '{part}' is a value, not a section")
        node = child
    node[leaf] = value


# -- paths: resolved once, here on the driver, before anything starts ---------------------

def cluster_of(cfg: ShardlineConfig, engines: list[str], spark=None, client=None) -> str | None:
    """The setting that sends tasks to other hosts, among the engines a command uses; None
    when every task runs on this machine (embedded Spark `local[...]`, a LocalCluster, a
    scheduler or standalone master on loopback, whose workers can only be on this machine).
    spark, client: a SparkSession or Dask client the caller gave (the API's `spark=`,
    `client=`): where it runs, not the config, says (shardline.engines.base.Engine.cluster)."""
    given = given_engines(spark, client)
    for engine in engines:
        where = engine_class(engine).cluster(cfg, given.get(engine))
        if where:
            return where
    return None


SOURCE, DATASET, CHECKPOINTS, OUTPUT = (
    "pipelines.source.path", "pipelines.dataset_dir", "training.checkpoint_dir", "serving.output_dir"
)


def resolve_paths(
    cfg: ShardlineConfig, engines: Sequence[str | None], uses: tuple[str, ...] = (), *,
    tracking: bool = False, sweep: bool = False, spark=None, client=None, apart: tuple[str, ...] | None = None,
) -> ShardlineConfig:
    """Every path setting as every host will open it (foundation.storage.resolve): local
    paths absolute, URLs as they are. When `engines` run tasks on other hosts, a relative
    path among the settings the command `uses` is refused, and so is a relative SQLite
    file as the MLflow store (`tracking`) or the Optuna storage (`sweep`) its tasks open;
    absolute local ones get a note (every host must see them: a shared filesystem).
    spark, client: the caller's own engines (see cluster_of). apart: the folders that must
    not hold one another (foundation.overlap; default: those the command `uses`).
    """
    cluster = cluster_of(cfg, [e for e in engines if e], spark, client)
    local: list[str] = []

    def path(value: str, setting: str) -> str:
        read = setting != SOURCE or cfg.pipelines.source.reads_path
        checked = cluster if setting in uses and read else None
        resolved = resolve(value, setting, checked)
        if checked and not is_remote(resolved):
            local.append(setting)
        return resolved

    p, t, s = cfg.pipelines, cfg.training, cfg.serving
    source = p.source.model_copy(update={"path": path(p.source.path, SOURCE)})
    dataset_dir = path(p.dataset_dir, DATASET)
    checkpoint_dir = path(_job_folder(cfg)[0], CHECKPOINTS)
    output_dir = path(s.output_dir, OUTPUT)
    tracking_uri = _sqlite(cfg.tracking.resolved_uri(), "tracking.tracking_uri", cluster if tracking else None,
                           "an MLflow tracking server (tracking.tracking_uri = 'http://host:5000')", local)
    sweep_storage = cfg.sweep.storage
    if sweep:
        from shardline.training.sweeps.study import resolve_storage

        sweep_storage = _sqlite(resolve_storage(cfg.sweep, tracking_uri), "sweep.storage", cluster,
                                "a database server every host reaches (sweep.storage = 'postgresql://...')", local)
    resolved = cfg.model_copy(
        update={
            "pipelines": p.model_copy(update={"source": source, "dataset_dir": dataset_dir}),
            "training": t.model_copy(update={"checkpoint_dir": checkpoint_dir}),
            "serving": s.model_copy(update={"output_dir": output_dir}),
            "tracking": cfg.tracking.model_copy(update={"tracking_uri": tracking_uri}),
            "sweep": cfg.sweep.model_copy(update={"storage": sweep_storage}),
        }
    )
    check_folders(resolved, uses if apart is None else apart)  # refused before the note: one line
    if local:
        names = " and ".join([", ".join(local[:-1]), local[-1]] if len(local) > 1 else local)
        report.line(f"[shardline] note: {cluster} runs tasks on other hosts, and {names} "
                    f"{'is a path' if len(local) == 1 else 'are paths'} on this machine: every host must see "
                    f"{'it' if len(local) == 1 else 'them'} at the same path (a shared filesystem); else use "
                    f"URLs (s3://bucket/prefix) and an MLflow server")
    return resolved


def check_folders(cfg: ShardlineConfig, settings: tuple[str, ...], others: tuple[tuple[str, str], ...] = ()) -> None:
    """The folders of `settings` (resolved) and `others` ((name, URL): a path given on the
    command line) apart from one another (foundation.overlap). A source that is no folder
    (an Iceberg or Spark table) has none."""
    named = [(s, glob_base(path_of(cfg, s)) if s == SOURCE else path_of(cfg, s))
             for s in settings if s != SOURCE or cfg.pipelines.source.reads_path]
    check_apart(named + list(others))


def _job_folder(cfg: ShardlineConfig) -> tuple[str, bool]:
    """The job's checkpoint folder as its store decides it (CheckpointStore.job_folder), and
    whether it is the job's own. The training stage prints it."""
    return CheckpointStore.job_folder(cfg.training, cfg.tracking.experiment, cfg.tracking.registered_model,
                                      cfg.pipelines.dataset_dir)


def checkpoint_store(given: ShardlineConfig, resolved: ShardlineConfig) -> CheckpointStore:
    """The job's CheckpointStore: the folder resolve_paths gave `resolved`; the job's own (a
    new run there replaces an earlier one that differs only in what the folder's name leaves
    out) when the config as `given` leaves it unset."""
    return CheckpointStore(resolved.training.checkpoint_dir, own=_job_folder(given)[1])


def path_of(cfg: ShardlineConfig, setting: str) -> str:
    section, _, field = setting.rpartition(".")
    node = cfg
    for part in section.split("."):
        node = getattr(node, part)
    return getattr(node, field)


def check_storage(
    cfg: ShardlineConfig, reads: tuple[str, ...] = (), writes: tuple[str, ...] = (),
    other_reads: tuple[tuple[str, str], ...] = (),
) -> None:
    """Every store the command reads or writes answers, with access, in seconds, before an
    engine starts (foundation.storage.check_access). A synthetic source is written, not read.
    other_reads: (what to call it, URL) of paths given on the command line."""
    if SOURCE in reads and cfg.pipelines.source.format == "synthetic":
        reads, writes = tuple(r for r in reads if r != SOURCE), (*writes, SOURCE)
    if not cfg.pipelines.source.reads_path:  # an Iceberg table or a Spark table: no path is read
        reads = tuple(r for r in reads if r != SOURCE)
    for setting, url in [(r, path_of(cfg, r)) for r in reads] + list(other_reads):
        check_access(url, setting)
    for setting in writes:
        check_access(path_of(cfg, setting), setting, write=True)


def _sqlite(url: str, setting: str, cluster: str | None, instead: str, local: list[str]) -> str:
    """A SQLite URL made absolute; a relative one refused on a cluster, an absolute one noted."""
    if not url.startswith("sqlite:///"):
        return url
    path = url[len("sqlite:///") :]
    if path in ("", ":memory:"):
        return url
    if not path.startswith("/"):
        if cluster:
            raise ConfigError(
                f"{setting} = {url!r} is a SQLite file relative to this folder, but {cluster} runs "
                f"tasks on other hosts, which would each open a file of their own; use {instead}"
            )
        return f"sqlite:///{os.path.abspath(path)}"
    if cluster:
        local.append(setting)
    return url
