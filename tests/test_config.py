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


def test_a_mistake_in_an_override_is_blamed_on_the_override_not_the_file(tmp_path):
    """#53 item 11: `--set training.epochz=3` said "job.toml: unknown setting"."""
    cases = [
        (["training.epochz=3"], "--set training.epochz=3: unknown setting 'training.epochz'"),
        (["training={epochz=3}"], "--set training={epochz=3}: unknown setting 'training.epochz'"),
        ({"training.epochz": 3}, "overrides['training.epochz']: unknown setting 'training.epochz'"),
        (["training.seed='zero'"], "--set training.seed='zero': training.seed: Input should be a valid integer"),
    ]
    for overrides, message in cases:
        with pytest.raises(ConfigError) as e:
            load_config(QUICKSTART, overrides)
        assert str(e.value).startswith(message), (overrides, str(e.value))
    # A mistake in the file is still the file's, whatever else is overridden.
    (tmp_path / "bad.toml").write_text("[training]\nepochz = 3\n")
    with pytest.raises(ConfigError) as e:
        load_config(tmp_path / "bad.toml", ["training.epochs=2"])
    assert str(e.value) == f"{tmp_path / 'bad.toml'}: unknown setting 'training.epochz'"


def test_a_delta_timestamp_may_be_a_toml_datetime(tmp_path):
    """#53 item 13: `--set pipelines.source.timestamp=2026-11-28T23:42:48Z` was refused with
    "Input should be a valid string"; a TOML datetime (or date), unquoted, is a time too."""
    import datetime as dt

    base = ["pipelines.source.format='delta'", "pipelines.source.path='t'"]
    for given, text in [("2026-11-28T23:42:48Z", "2026-11-28T23:42:48+00:00"),
                        ("2026-11-28T23:42:48", "2026-11-28T23:42:48"), ("2026-11-28", "2026-11-28"),
                        ("'2026-11-28T23:42:48Z'", "2026-11-28T23:42:48Z")]:
        src = load_config(None, [*base, f"pipelines.source.timestamp={given}"]).pipelines.source
        assert src.timestamp == text
        assert src.pinned_time() == dt.datetime(2026, 11, 28, *((23, 42, 48) if "T" in given else ()),
                                                tzinfo=dt.timezone.utc)
    path = tmp_path / "job.toml"
    path.write_text("[pipelines.source]\nformat = 'delta'\npath = 't'\ntimestamp = 2026-11-28T23:42:48Z\n")
    assert load_config(path).pipelines.source.timestamp == "2026-11-28T23:42:48+00:00"
    api = {"pipelines.source.timestamp": dt.datetime(2026, 11, 28, tzinfo=dt.timezone.utc)}  # a Python caller's
    given = load_config({"pipelines": {"source": {"format": "delta", "path": "t"}}}, api)
    assert given.pipelines.source.timestamp == "2026-11-28T00:00:00+00:00"


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
