"""Each strategy's settings sub-table ([training.pipeline], ...) and the earlier flat names
(training.micro_batches, ...), which stay accepted everywhere a config is given and give the
same config and the same checkpoint fingerprint; the strategy as one object per job.

In-process: config loading, fingerprints and the strategy objects, no engine, no process group.
"""

from __future__ import annotations

import pickle
import re
from pathlib import Path

import pytest

from shardline.config import ShardlineConfig, load_config
from shardline.foundation.errors import ConfigError
from shardline.training.checkpoints import fingerprint
from shardline.training.config import TrainingConfig
from shardline.training.strategies import strategy_for
from shardline.training.strategy_settings import FLAT_NAMES, TABLES, merge_settings
from shardline.training.sweeps.config import SweepConfig, tunable
from shardline.training.loop.runner import RankJob

from .conftest import REPO

# One value per flat name, none of them its default.
VALUES = {
    "grad_compression": "fp16", "dp_shard": 2, "tp": 2, "tp_plan": {"1.linear": "colwise", "2.linear": "rowwise"},
    "pp": 2, "pipeline_schedule": "interleaved-1f1b", "pipeline_stages_per_rank": 3, "micro_batches": 8,
    "pipeline_boundaries": [1, 2, 3], "pipeline_timing": True, "ps_servers": 2, "ps_mode": "async",
    "ps_staleness": 5,
}


def _nested(flat: dict) -> dict:
    out: dict = {}
    for name, value in flat.items():
        table, field = FLAT_NAMES[name]
        out.setdefault(table, {})[field] = value
    return out


def test_every_flat_name_has_a_value_here_and_a_field_in_its_table():
    assert set(VALUES) == set(FLAT_NAMES)
    for name, (table, field) in FLAT_NAMES.items():
        assert field in TABLES[table].model_fields, name
        assert TABLES[table].model_fields[field].default != VALUES[name], name


@pytest.mark.parametrize("name", sorted(FLAT_NAMES))
def test_a_flat_name_and_its_sub_table_give_the_same_config(name):
    table, field = FLAT_NAMES[name]
    flat = TrainingConfig(**{name: VALUES[name]})
    nested = TrainingConfig(**{table: {field: VALUES[name]}})
    assert flat == nested
    assert getattr(getattr(flat, table), field) == VALUES[name] == getattr(nested, name)
    assert fingerprint.fingerprint(flat, "v") == fingerprint.fingerprint(nested, "v")


def test_flat_and_sub_tables_agree_through_toml_set_and_the_api(tmp_path):
    flat_toml = tmp_path / "flat.toml"
    flat_toml.write_text("[training]\nstrategy = 'pipeline'\nmicro_batches = 8\npipeline_schedule = 'gpipe'\n"
                         "tp_plan = { '1.linear' = 'colwise', '2.linear' = 'rowwise' }\n")
    nested_toml = tmp_path / "nested.toml"
    nested_toml.write_text("[training]\nstrategy = 'pipeline'\n[training.pipeline]\nmicro_batches = 8\n"
                           "schedule = 'gpipe'\n[training.tensor]\nplan = { '1.linear' = 'colwise', "
                           "'2.linear' = 'rowwise' }\n")
    plan = {"1.linear": "colwise", "2.linear": "rowwise"}
    configs = [
        load_config(flat_toml),
        load_config(nested_toml),
        load_config(None, ["training.strategy=pipeline", "training.micro_batches=8", "training.pipeline_schedule=gpipe",
                           "training.tp_plan={'1.linear'='colwise','2.linear'='rowwise'}"]),
        load_config(None, ["training.strategy=pipeline", "training.pipeline.micro_batches=8",
                           "training.pipeline.schedule=gpipe",
                           "training.tensor.plan={'1.linear'='colwise','2.linear'='rowwise'}"]),
        load_config(None, {"training.strategy": "pipeline", "training.micro_batches": 8,
                           "training.pipeline_schedule": "gpipe", "training.tp_plan": plan}),
        load_config({"training": {"strategy": "pipeline", "pipeline": {"micro_batches": 8, "schedule": "gpipe"},
                                  "tensor": {"plan": plan}}}),
    ]
    for cfg in configs:
        assert cfg.training == configs[0].training
        t = cfg.training
        assert (t.micro_batches, t.pipeline.micro_batches, t.pipeline_schedule, t.tp_plan) == (8, 8, "gpipe", plan)


def test_set_of_a_sub_table_setting_goes_through_the_clis_override_path():
    # load_config with `--set` strings is what `shardline train --set ...` runs (jobs/cli.py, shardline.config).
    cfg = load_config(REPO / "jobs" / "configs" / "quickstart.toml",
                      ["training.strategy=pipeline", "training.pipeline.micro_batches=8"])
    assert cfg.training.pipeline.micro_batches == 8 and cfg.training.micro_batches == 8
    with pytest.raises(ConfigError, match=r"training.pipeline.micro_batches: Input should be greater than or equal to 1"):
        load_config(None, ["training.pipeline.micro_batches=0"])
    with pytest.raises(ConfigError, match=r"unknown setting 'training.pipeline.micro_batch'"):
        load_config(None, ["training.pipeline.micro_batch=8"])


@pytest.mark.parametrize("given", [
    {"training.tp": 2, "training.tensor.tp": 4},
    {"training.micro_batches": 8, "training.pipeline.micro_batches": 2},
])
def test_a_flat_name_and_its_sub_table_field_with_different_values_is_refused_in_one_line(given):
    (flat, a), (nested, b) = given.items()
    with pytest.raises(ConfigError) as err:
        load_config(None, given)
    message = str(err.value)
    assert "\n" not in message
    assert f"{flat} = {a}" in message and f"{nested} = {b}" in message, message
    # The same value both ways is one setting given twice: accepted.
    assert load_config(None, {flat: a, nested: a}).training == load_config(None, {nested: a}).training


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
            assert load_config(path, [override]).training.micro_batches == 8, (path.name, override)
        assert load_config(path, {"training.micro_batches": 8}).training.pipeline.micro_batches == 8
        # The same name twice: the later one wins, as with any setting.
        assert load_config(path, ["training.micro_batches=8", "training.micro_batches=16"]).training.micro_batches == 16


def test_a_config_passed_back_in_keeps_what_was_set_either_way():
    # The API dumps a ShardlineConfig with exclude_unset and validates it again (shardline/config.py).
    first = load_config(None, {"training.tp": 2, "training.pipeline.micro_batches": 8, "training.ps_mode": "async"})
    again = load_config(first)
    assert again.training == first.training
    assert (again.training.tp, again.training.micro_batches, again.training.ps_mode) == (2, 8, "async")
    assert again.training.model_dump(exclude_unset=True) == {
        "tensor": {"tp": 2}, "pipeline": {"micro_batches": 8}, "ps": {"mode": "async"}}
    # An override on top of it, by either name, is no conflict with what it holds.
    more = load_config(again, {"training.micro_batches": 16, "training.tensor.tp": 4})
    assert (more.training.micro_batches, more.training.tp, more.training.ps_mode) == (16, 4, "async")
    assert ShardlineConfig.model_validate(more.model_dump()) == more


def test_model_copy_takes_a_flat_name_into_its_sub_table():
    cfg = TrainingConfig(strategy="pipeline", micro_batches=4)
    copied = cfg.model_copy(update={"micro_batches": 8, "tp": 2, "epochs": 2})
    assert (copied.pipeline.micro_batches, copied.tensor.tp, copied.epochs) == (8, 2, 2)
    assert (cfg.micro_batches, cfg.tp) == (4, None)  # the original is untouched
    assert copied.model_dump(exclude_unset=True) == {
        "strategy": "pipeline", "pipeline": {"micro_batches": 8}, "tensor": {"tp": 2}, "epochs": 2}


def test_fingerprints_stay_as_the_flat_settings_wrote_them():
    """Checkpoints written before the sub-tables must resume: the same settings give the same
    fingerprint strings. `expected` is what the version with flat settings computed (then the
    only form) for this config."""
    cfg = TrainingConfig(
        strategy="pipeline", world_size=4, dp=2, pipeline={"pp": 2, "micro_batches": 8, "schedule": "interleaved-1f1b",
                                                          "stages_per_rank": 2, "boundaries": [1, 2, 3]},
        tensor={"plan": {"1.linear": "colwise", "2.linear": "rowwise"}}, ddp={"grad_compression": "fp16"},
        ps={"servers": 2, "mode": "async"},
    )
    expected = {
        "strategy": "pipeline", "world_size": "4", "dp": "2", "tp": "None", "pp": "2", "dp_shard": "None",
        "tp_plan": "{'1.linear': 'colwise', '2.linear': 'rowwise'}", "ps_servers": "2", "ps_mode": "async",
        "micro_batches": "8", "pipeline_boundaries": "[1, 2, 3]", "pipeline_schedule": "interleaved-1f1b",
        "pipeline_stages_per_rank": "2", "grad_compression": "fp16", "dataset_version": "v1",
    }
    fp = fingerprint.fingerprint(cfg, "v1")
    assert {k: fp[k] for k in expected} == expected


def test_a_sweep_searches_a_strategy_setting_by_its_flat_name():
    names = tunable()
    assert "micro_batches" in names and "ps_staleness" in names and not set(TABLES) & set(names)
    sweep = SweepConfig(space={"micro_batches": {"type": "categorical", "choices": [2, 4]}})
    assert sweep.space["micro_batches"].choices == [2, 4]
    with pytest.raises(ValueError, match=r"micro_batches: 0 is not a valid training.micro_batches"):
        SweepConfig(space={"micro_batches": {"type": "categorical", "choices": [0, 4]}})
    # A trial's config: the base's full dump (every sub-table at its values) with the trial's
    # flat-named values over it (training.sweeps.run._run_trial), validated.
    base = TrainingConfig(strategy="pipeline", micro_batches=4, pipeline_schedule="gpipe")
    trial = TrainingConfig.model_validate(merge_settings(base.model_dump(), {"micro_batches": 8, "lr": 0.1}))
    assert (trial.micro_batches, trial.pipeline_schedule, trial.lr) == (8, "gpipe", 0.1)


def test_the_strategy_is_one_object_with_its_settings_and_mesh_that_travels_in_the_job():
    cfg = TrainingConfig(strategy="pipeline", world_size=4, dp=2, micro_batches=2)
    strategy = strategy_for(cfg)
    assert strategy.name == "pipeline" and strategy.settings is cfg.pipeline
    assert (strategy.mesh.dp, strategy.mesh.inner, strategy.data_world) == (2, 2, 2)
    job = RankJob(cfg=cfg, dataset_dir="unused", strategy=strategy)
    assert job.strategy is strategy
    back = pickle.loads(pickle.dumps(job))  # as launchers ship the job to Spark, Dask and processes
    assert back.strategy.settings == cfg.pipeline and back.strategy.data_world == 2
    ps = strategy_for(TrainingConfig(strategy="ps", world_size=3))
    assert (ps.mesh, ps.data_world, ps.settings.servers) == (None, 2, 1)
    # Optional features come from the base class, not from probing for attributes.
    ddp = strategy_for(TrainingConfig(strategy="ddp"))
    assert (ddp.builds_model, strategy_for(TrainingConfig(strategy="fsdp")).builds_model) == (False, True)
    assert ddp.describe(cfg, None) == ""


def test_no_module_outside_the_registry_tests_a_strategy_by_name():
    """Strategy-specific behaviour lives in training/strategies/: elsewhere the code asks the
    strategy object, never compares training.strategy with a name."""
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
