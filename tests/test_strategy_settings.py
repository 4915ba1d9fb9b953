"""One name per setting: the mesh ([training.mesh]) and each strategy's sub-table
([training.pipeline], ...) are the names, in TOML, `--set`, the API, sweeps, fingerprints
and MLflow; an earlier name (training.tp, training.micro_batches, training.dp, ...) is read by
the config reader as its name now, with one line saying so, and old checkpoints' fingerprints
and folders are read as the same job's. The strategy is one object per job.

In-process: config loading, fingerprints and the strategy objects, no engine, no process group.
"""

from __future__ import annotations

import hashlib
import json
import pickle
import re
from pathlib import Path

import pytest

from shardline.config import ShardlineConfig, load_config
from shardline.foundation import report
from shardline.foundation.errors import ConfigError
from shardline.training.checkpoints import fingerprint
from shardline.training.config import TrainingConfig, setting_field
from shardline.training.strategies import strategy_for
from shardline.training.strategy_settings import RENAMED, TABLES
from shardline.training.sweeps.config import SweepConfig, tunable, with_setting
from shardline.training.loop.runner import RankJob

from .conftest import REPO

# One value per earlier name, none of them its new setting's default.
VALUES = {
    "dp": 2, "grad_compression": "fp16", "dp_shard": 2, "fsdp.dp_shard": 2, "tp": 2, "tensor.tp": 2,
    "tp_plan": {"1.linear": "colwise", "2.linear": "rowwise"}, "pp": 2, "pipeline.pp": 2,
    "pipeline_schedule": "interleaved-1f1b", "pipeline_stages_per_rank": 3, "micro_batches": 8,
    "pipeline_boundaries": [1, 2, 3], "pipeline_timing": True, "ps_servers": 2, "ps_mode": "async",
    "ps_staleness": 5,
}


class Lines(report.Reporter):
    def __init__(self):
        self.said: list[str] = []

    def line(self, text: str) -> None:
        self.said.append(text.strip())


def _nested(path: str, value) -> dict:
    table, _, field = path.rpartition(".")
    return {table: {field: value}} if table else {field: value}


def test_every_earlier_name_has_a_value_here_and_names_a_setting_now():
    assert set(VALUES) == set(RENAMED)
    for old, new in RENAMED.items():
        assert setting_field(new).default != VALUES[old], old
    # Nothing answers to an earlier name any more: no properties, no shim in the model.
    for old in (o for o in RENAMED if "." not in o):
        assert not hasattr(TrainingConfig(), old), old
    with pytest.raises(ValueError, match="Extra inputs are not permitted"):
        TrainingConfig(tp=2)


@pytest.mark.parametrize("old", sorted(RENAMED))
def test_an_earlier_name_reads_as_its_new_one_with_one_line(old, tmp_path):
    new = RENAMED[old]
    toml = tmp_path / "job.toml"
    table, _, field = old.rpartition(".")
    value = json.dumps(VALUES[old]).replace(":", "=") if isinstance(VALUES[old], dict) else json.dumps(VALUES[old])
    toml.write_text(f"[training{'.' + table if table else ''}]\n{field} = {value}\n")
    want = TrainingConfig(**_nested(new, VALUES[old]))
    for source, overrides in ((toml, ()), (None, {f"training.{old}": VALUES[old]})):
        with report.using(Lines()) as lines:
            got = load_config(source, overrides).training
        assert got == want, old
        assert len(lines.said) == 1 and f"training.{old} is now training.{new}" in lines.said[0], lines.said
    assert fingerprint.fingerprint(got, "v") == fingerprint.fingerprint(want, "v")


def test_the_new_names_through_toml_set_and_the_api_agree_and_say_nothing(tmp_path):
    path = tmp_path / "job.toml"
    path.write_text("[training]\nworld_size = 4\n[training.mesh]\ndp_shard = 2\ntp = 2\n"
                    "[training.pipeline]\nmicro_batches = 8\n")
    with report.using(Lines()) as lines:
        configs = [
            load_config(path),
            load_config(None, ["training.world_size=4", "training.mesh.dp_shard=2", "training.mesh.tp=2",
                               "training.pipeline.micro_batches=8"]),
            load_config(None, {"training.world_size": 4, "training.mesh.dp_shard": 2, "training.mesh.tp": 2,
                               "training.pipeline.micro_batches": 8}),
            load_config({"training": {"world_size": 4, "mesh": {"dp_shard": 2, "tp": 2},
                                      "pipeline": {"micro_batches": 8}}}),
        ]
    assert lines.said == []
    for cfg in configs:
        assert cfg.training == configs[0].training
    assert strategy_for(configs[0].training).mesh.named() == "dp_shard 2 x tp 2"
    with pytest.raises(ConfigError, match=r"unknown setting 'training.mesh.dp'"):
        load_config(None, ["training.mesh.dp=2"])


@pytest.mark.parametrize("given", [
    {"training.tp": 2, "training.mesh.tp": 4},
    {"training.micro_batches": 8, "training.pipeline.micro_batches": 2},
])
def test_an_earlier_name_and_its_new_one_with_different_values_is_refused_in_one_line(given):
    (old, a), (new, b) = given.items()
    with pytest.raises(ConfigError) as err:
        load_config(None, given)
    message = str(err.value)
    assert "\n" not in message
    assert f"{old} = {a}" in message and f"{new} = {b}" in message, message
    # The same value both ways is one setting given twice: accepted.
    assert load_config(None, {old: a, new: a}).training == load_config(None, {new: a}).training


def test_the_conflict_is_refused_within_a_toml_file_naming_it(tmp_path):
    path = tmp_path / "job.toml"
    path.write_text("[training]\nps_servers = 2\n[training.ps]\nservers = 3\n")
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert str(err.value).startswith(f"{path}: training.ps_servers = 2 and training.ps.servers = 3 are one setting")


def test_an_override_replaces_the_files_setting_whichever_name_each_uses(tmp_path):
    nested, flat = tmp_path / "nested.toml", tmp_path / "flat.toml"
    nested.write_text("[training]\nstrategy = 'pipeline'\n[training.pipeline]\nmicro_batches = 2\n")
    flat.write_text("[training]\nstrategy = 'pipeline'\nmicro_batches = 2\n")
    for path in (nested, flat):
        for override in ("training.micro_batches=8", "training.pipeline.micro_batches=8"):
            assert load_config(path, [override]).training.pipeline.micro_batches == 8, (path.name, override)
    # A config passed back in (the API dumps it with exclude_unset) holds the new names only.
    again = load_config(load_config(flat))
    assert again.training.model_dump(exclude_unset=True) == {"strategy": "pipeline", "pipeline": {"micro_batches": 2}}
    assert ShardlineConfig.model_validate(again.model_dump()) == again


def test_a_checkpoint_fingerprinted_under_the_earlier_names_is_the_same_jobs():
    """A checkpoint written before the mesh and the sub-tables holds the flat names
    (`expected_old`, what that version computed for these settings): it reads as the same
    job (no difference outside the mesh, which reshards), and the job's own checkpoint
    folder is the one that version named, so `--resume` across the upgrade finds it."""
    cfg = TrainingConfig(
        strategy="pipeline", world_size=4, mesh={"dp_replicate": 2},
        pipeline={"micro_batches": 8, "schedule": "interleaved-1f1b", "stages_per_rank": 2, "boundaries": [1, 2, 3]},
        tensor={"plan": {"1.linear": "colwise", "2.linear": "rowwise"}}, ps={"mode": "async"},
    )
    new = fingerprint.fingerprint(cfg, "v1")
    assert (new["mesh.pp"], new["mesh.dp_replicate"], new["pipeline.micro_batches"]) == ("2", "2", "8")
    expected_old = {**{k: v for k, v in new.items() if "." not in k}, "dp": "2", "tp": "None", "pp": "None",
                    "dp_shard": "None", "tp_plan": "{'1.linear': 'colwise', '2.linear': 'rowwise'}", "ps_servers": "1",
                    "ps_mode": "async", "micro_batches": "8", "pipeline_boundaries": "[1, 2, 3]",
                    "pipeline_schedule": "interleaved-1f1b", "pipeline_stages_per_rank": "2", "grad_compression": "none"}
    assert fingerprint.differences(expected_old, fingerprint.comparable(new)) == []
    assert fingerprint.differences({**expected_old, "micro_batches": "4"}, fingerprint.comparable(new)) == \
        ["pipeline.micro_batches"]
    # The folder: the earlier version hashed these flat-named settings (not the mesh, not what a resume may change).
    kept = ["model", "model_args", "loss", "hidden", "heads", "embedding_dim", "strategy", "batch_size", "seed",
            "shuffle_buffer_rows", "remainder", "ps_mode", "micro_batches", "pipeline_schedule", "precision",
            "grad_compression"]
    ident = {k: expected_old[k] for k in kept}
    ident.update(dataset_dir="/data/set", registered_model="m")
    digest = hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:10]
    assert fingerprint.job_dir(cfg, "exp", "m", "/data/set", root="/ck") == f"/ck/exp/m-{digest}"


def test_a_sweep_searches_a_sub_table_setting_by_its_name():
    names = tunable()
    assert {"pipeline.micro_batches", "ps.staleness", "mesh.tp"} <= set(names) and not set(TABLES) & set(names)
    sweep = SweepConfig(space={"pipeline.micro_batches": {"type": "categorical", "choices": [2, 4]}})
    assert sweep.space["pipeline.micro_batches"].choices == [2, 4]
    with pytest.raises(ValueError, match=r"pipeline.micro_batches: 0 is not a valid training.pipeline.micro_batches"):
        SweepConfig(space={"pipeline.micro_batches": {"type": "categorical", "choices": [0, 4]}})
    # A trial's config: the base's full dump with the trial's values over it (sweeps.trials._run_trial).
    base = TrainingConfig(strategy="pipeline", pipeline={"micro_batches": 4, "schedule": "gpipe"})
    settings = with_setting(with_setting(base.model_dump(), "pipeline.micro_batches", 8), "lr", 0.1)
    trial = TrainingConfig.model_validate(settings)
    assert (trial.pipeline.micro_batches, trial.pipeline.schedule, trial.lr) == (8, "gpipe", 0.1)
    assert base.pipeline.micro_batches == 4  # the base is untouched


def test_a_sweep_space_under_an_earlier_name_reads_as_the_new_one(tmp_path):
    path = tmp_path / "sweep.toml"
    path.write_text("[sweep.space.micro_batches]\ntype = 'categorical'\nchoices = [2, 4]\n")
    with report.using(Lines()) as lines:
        cfg = load_config(path)
    assert list(cfg.sweep.space) == ["pipeline.micro_batches"]
    assert len(lines.said) == 1 and 'sweep.space."pipeline.micro_batches"' in lines.said[0], lines.said


def test_the_strategy_is_one_object_with_its_settings_and_mesh_that_travels_in_the_job():
    cfg = TrainingConfig(strategy="pipeline", world_size=4, mesh={"dp_replicate": 2}, pipeline={"micro_batches": 2})
    strategy = strategy_for(cfg)
    assert strategy.name == "pipeline" and strategy.settings is cfg.mesh
    assert (strategy.mesh.dp_replicate, strategy.mesh.pp, strategy.data_world) == (2, 2, 2)
    job = RankJob(cfg=cfg, dataset_dir="unused", strategy=strategy)
    assert job.strategy is strategy
    back = pickle.loads(pickle.dumps(job))  # as launchers ship the job to Spark, Dask and processes
    assert back.strategy.mesh == strategy.mesh and back.strategy.data_world == 2
    ps = strategy_for(TrainingConfig(strategy="ps", world_size=3))
    assert (ps.mesh, ps.data_world, ps.settings.servers) == (None, 2, 1)
    # Optional features come from the base class, not from probing for attributes.
    ddp = strategy_for(TrainingConfig(strategy="ddp"))
    assert (ddp.builds_model, strategy_for(TrainingConfig(strategy="fsdp")).builds_model) == (False, True)
    assert ddp.describe(cfg, None) == ""


def test_the_settings_module_imports_no_config_module():
    """The import circle between training/config.py and strategy_settings.py is gone: the
    sub-tables are the config's parts, and know nothing of it."""
    text = (REPO / "training" / "strategy_settings.py").read_text()
    assert not re.search(r"^\s*from \.config import|^\s*from \.\.?config|import shardline\.training\.config", text,
                         re.MULTILINE)


def test_no_module_outside_the_registry_tests_a_strategy_by_name():
    """Strategy-specific behaviour lives in training/strategies/ and the mesh's shape: elsewhere
    the code asks the strategy object, never compares training.strategy with a name."""
    pattern = re.compile(r"strategy\s*(==|!=)|(==|!=)\s*\S*strategy\b|strategy\s+(not\s+)?in\s*[(\[{]")
    found = []
    # shardline/<package> are links to the top-level folders: each file once, by its real path.
    files = {p.resolve() for folder in ("training", "serving", "shardline", "jobs", "pipelines")
             for p in (REPO / folder).rglob("*.py")}
    for path in sorted(files):
        if Path("training", "strategies") in path.relative_to(REPO.resolve()).parents:
            continue
        for i, line in enumerate(path.read_text().splitlines(), 1):
            if pattern.search(line.split("#", 1)[0]):
                found.append(f"{path.relative_to(REPO.resolve())}:{i}: {line.strip()}")
    assert not found, found
