"""The engines by name (#54 item 1): the settings' values name a class each; an unknown name is
one line listing the valid ones; every engine answers what every stage asks, and the local
processes refuse the task stages in one line. No engine starts here (the session's Spark and
Dask are only wrapped), so the file costs well under a second."""

from __future__ import annotations

import inspect

import pytest

from shardline.engines import ENGINES, DaskEngine, Engine, LocalEngine, SparkEngine, engine_class
from shardline.foundation.errors import ConfigError
from shardline.pipelines.config import PipelineConfig
from shardline.serving.config import ServingConfig
from shardline.training.config import TrainingConfig


def test_every_setting_value_names_an_engine_and_nothing_else_does():
    values = {*TrainingConfig.model_fields["launcher"].annotation.__args__,
              *PipelineConfig.model_fields["engine"].annotation.__args__,
              *ServingConfig.model_fields["engine"].annotation.__args__}
    assert values == set(ENGINES) == {"spark", "dask", "local"}
    assert [engine_class(name).name for name in ENGINES] == list(ENGINES)
    with pytest.raises(ConfigError, match=r"^training.launcher = 'ray': no such engine \(valid: spark, dask, local\)$"):
        engine_class("ray", "training.launcher")


def test_every_engine_implements_the_whole_interface():
    abstract = {name for name, f in inspect.getmembers(Engine) if getattr(f, "__isabstractmethod__", False)}
    assert {"open", "cluster", "listen_address", "ship_code", "slots", "run", "shuffle_write", "stage_frame",
            "run_units", "check_capacity", "launch_ranks"} <= abstract
    for cls in (SparkEngine, DaskEngine, LocalEngine):
        assert not cls.__abstractmethods__, (cls.name, cls.__abstractmethods__)


def test_local_processes_run_ranks_only_and_say_so():
    local = LocalEngine()
    for call, what in ((lambda: local.run(len, [1]), "prepare"), (lambda: local.run_units([]), "scoring"),
                       (lambda: local.table_frame(None), "pipelines.source.format = 'table'")):
        with pytest.raises(ConfigError, match=what):
            call()
    slots = local.slots(threads_per_rank=2)
    assert slots.count >= 1 and slots.per_rank == 2 and slots.workers == ()
    assert local.cluster(None) is None and local.listen_address() == "127.0.0.1"


def test_the_session_engines_count_their_slots(spark, dask_client):
    spark_slots = SparkEngine(spark).slots()
    assert (spark_slots.count, spark_slots.where) == (2, "2 task slots of Spark master local[2,1]")
    dask_slots = DaskEngine(dask_client).slots()
    assert dask_slots.count == 2 and len(dask_slots.workers) == 2
    assert dask_slots.where == f"2 Dask workers of {dask_client.scheduler.address}"
