"""Bad config: one line naming the file and field, exit code 2, nothing written."""

from __future__ import annotations

import pytest

from shardline.config import load_config
from shardline.foundation.errors import ConfigError

from .conftest import REPO, shardline, shardline_here

QUICKSTART = REPO / "jobs" / "configs" / "quickstart.toml"


def test_quickstart_config_is_valid():
    cfg = load_config(QUICKSTART)
    assert cfg.tracking.registered_model == "shardline-quickstart"
    assert cfg.training.launcher == "spark" and cfg.training.world_size == 2
    assert cfg.pipelines.source.synthetic.rows >= 200_000


def test_overrides_reach_every_section():
    cfg = load_config(
        QUICKSTART,
        [
            "training.epochs=7",
            "training.hidden=[32]",
            "training.model=mlp",
            "pipelines.source.synthetic.rows=123",
            "spark.conf={'spark.a' = 'b'}",
        ],
    )
    assert cfg.training.epochs == 7
    assert cfg.training.hidden == [32]
    assert cfg.pipelines.source.synthetic.rows == 123
    assert cfg.spark.conf == {"spark.a": "b"}


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["training.epochs=zero"], "training.epochs"),
        (["training.bogus=1"], "unknown setting 'training.bogus'"),
        (["pipelines.split.train=0.9"], "split fractions must sum to 1"),
        (["training.lr=-1"], "training.lr"),
        (["nonsense"], "expected section.field=value"),
    ],
)
def test_bad_values_name_the_field(overrides, message):
    with pytest.raises(ConfigError, match=message.replace(".", r"\.")):
        load_config(QUICKSTART, overrides)


@pytest.mark.parametrize(
    "content, message",
    [
        (None, "config file not found"),
        ("[training\nepochs = 3", "invalid TOML"),
        ("[training]\nepochz = 3\n", "unknown setting 'training.epochz'"),
        ("[training]\nepochs = 'three'\n", "training.epochs: Input should be a valid integer"),
    ],
)
def test_cli_bad_config_one_line_exit_2_nothing_written(tmp_path, content, message):
    config = tmp_path / "job.toml"
    if content is not None:
        config.write_text(content)
    before = sorted(p.name for p in tmp_path.iterdir())
    for command in ("run", "prepare", "train"):
        proc = shardline_here(command, str(config), cwd=tmp_path)
        assert proc.returncode == 2, proc.stderr
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1, proc.stderr
        assert str(config) in lines[0] and message in lines[0]
        assert "Traceback" not in proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == before


@pytest.mark.slow
def test_help_lists_the_commands(tmp_path):
    """Full tier only (`make test-all`, marker `slow`): the `shardline` command in a process of its
    own."""
    proc = shardline("--help", cwd=tmp_path)
    assert proc.returncode == 0
    for command in ("run", "prepare", "train", "score"):
        assert f"  {command} " in proc.stdout


def test_error_text_in_brackets_is_printed_verbatim(tmp_path):
    # rich would read "[v1]" as markup and drop it from the message.
    proc = shardline_here(
        "train", str(QUICKSTART), "--launcher", "local", "--set", 'pipelines.dataset_dir="data[v1]"',
        cwd=tmp_path,
    )
    assert proc.returncode == 1
    assert f"error: {tmp_path}/data[v1]/manifest.json: no manifest" in proc.stderr
    assert not (tmp_path / "data[v1]").exists()
