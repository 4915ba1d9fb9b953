"""One TOML file plus `--set section.field=value` overrides, composed from each package's own section."""

from __future__ import annotations

import tomllib
from pathlib import Path

from pydantic import Field, ValidationError

from pipelines.config import DaskConfig, PipelineConfig, Section, SparkConfig
from pipelines.errors import ConfigError
from serving.config import ServingConfig
from training.config import TrackingConfig, TrainingConfig
from training.sweep_config import SweepConfig


class ShardlineConfig(Section):
    spark: SparkConfig = Field(default_factory=SparkConfig)
    dask: DaskConfig = Field(default_factory=DaskConfig)
    pipelines: PipelineConfig = Field(default_factory=PipelineConfig)
    training: TrainingConfig = Field(default_factory=TrainingConfig)
    tracking: TrackingConfig = Field(default_factory=TrackingConfig)
    serving: ServingConfig = Field(default_factory=ServingConfig)
    sweep: SweepConfig = Field(default_factory=SweepConfig)


def load_config(path: str | Path | None, overrides: list[str] = ()) -> ShardlineConfig:
    """Read, override, validate. Every failure is one ConfigError naming file and field."""
    where = str(path) if path else "defaults"
    data: dict = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"{p}: config file not found")
        try:
            data = tomllib.loads(p.read_text())
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"{p}: invalid TOML: {e}") from None
        except UnicodeDecodeError:
            raise ConfigError(f"{p}: config file is not UTF-8 text") from None
    for item in overrides:
        _apply_override(data, item)
    try:
        return ShardlineConfig.model_validate(data)
    except ValidationError as e:
        err = e.errors()[0]
        field = ".".join(str(x) for x in err["loc"])
        if err["type"] == "extra_forbidden":
            raise ConfigError(f"{where}: unknown setting '{field}'") from None
        scalar = isinstance(err.get("input"), (str, int, float, bool))
        got = f" (got {err['input']!r})" if scalar else ""
        msg = err["msg"].removeprefix("Value error, ")
        raise ConfigError(f"{where}: {field}: {msg}{got}") from None


def _apply_override(data: dict, item: str) -> None:
    key, sep, raw = item.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"--set {item!r}: expected section.field=value")
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw  # a bare word is a string: --set training.model=mlp
    *parents, leaf = key.strip().split(".")
    node = data
    for part in parents:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"--set {item!r}: '{part}' is a value, not a section")
        node = child
    node[leaf] = value
