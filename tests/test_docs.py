"""The documentation a user reads (#38): the README's promises, and the reference pages
generated from the code (docs/gen_ref.py) are the code's current state.

No engine starts here: the pages are generated from the config models, the click CLI and
tests/bad_input_cases.py. `mkdocs build --strict` (links, anchors, the navigation) runs
in CI (`make docs`, .ci/run), not here: the test extra does not carry MkDocs.
"""

from __future__ import annotations

import importlib.util
import re

import click
import pytest
from pydantic import BaseModel

from shardline.jobs.cli import cli
from shardline.config import ShardlineConfig

from .conftest import REPO

README = REPO / "README.md"
REFERENCE = REPO / "docs" / "reference"


def _gen_ref():
    spec = importlib.util.spec_from_file_location("gen_ref", REPO / "docs" / "gen_ref.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_reference_pages_are_current():
    """A setting, flag or bad-input case added without `python docs/gen_ref.py` fails here."""
    stale = [p.name for p, text in _gen_ref().render().items() if not p.exists() or p.read_text() != text]
    assert not stale, f"docs/reference/{stale} differ from the code: run `python docs/gen_ref.py`"


def _settings(model: type[BaseModel], prefix: str) -> list[str]:
    """Every leaf setting's dotted name, walked here independently of the generator."""
    names = []
    for name, field in model.model_fields.items():
        ann, path = field.annotation, f"{prefix}.{name}"
        args = getattr(ann, "__args__", ())
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            names += _settings(ann, path)
        elif len(args) == 2 and isinstance(args[1], type) and issubclass(args[1], BaseModel):
            names += _settings(args[1], f"{path}.<name>")  # a table of sections: sweep.space.<name>
        else:
            names.append(path)
    return names


def test_settings_reference_lists_every_field():
    text = (REFERENCE / "settings.md").read_text()
    names = [n for section, f in ShardlineConfig.model_fields.items() for n in _settings(f.annotation, section)]
    assert len(names) > 100 and "training.model_args" in names and "sweep.space.<name>.low" in names
    missing = [n for n in names if f"| `{n}` |" not in text]
    assert not missing, missing


def _commands(cmd: click.Command, words: list[str]):
    yield words, cmd
    if isinstance(cmd, click.Group):
        for name, sub in cmd.commands.items():
            yield from _commands(sub, [*words, name])


def test_cli_reference_lists_every_command_and_flag():
    text = (REFERENCE / "cli.md").read_text()
    sections = dict(re.findall(r"^## `([^`]+)`\n(.*?)(?=^#{1,2} |\Z)", text, re.M | re.S))
    seen = 0
    for words, cmd in _commands(cli, ["shardline"]):
        section = sections.get(" ".join(words))
        assert section is not None, f"no section for `{' '.join(words)}`"
        for param in cmd.params:
            for opt in getattr(param, "opts", []) if isinstance(param, click.Option) else []:
                assert f"`{opt}`" in section, f"{' '.join(words)}: {opt}"
                seen += 1
    assert seen > 40
    assert "python -m shardline.jobs.faults" in sections and "`--case`" in sections["python -m shardline.jobs.faults"]


def test_readme_is_short_and_opens_with_the_support_matrix():
    lines = README.read_text().splitlines()
    assert len(lines) <= 300, len(lines)
    head = "\n".join(lines[:80])
    assert "## Support matrix" in head
    matrix = head.split("## Support matrix", 1)[1]
    for fact in ("Spark Connect", "standalone", "spark-submit", "Dask", "fsdp", "tensor", "pipeline", "ps",
                 "moto_server", "never run", "GPU", "YARN", "Kubernetes", "GCS", "Azure", "HDFS"):
        assert fact in matrix, fact


def test_readme_commands_and_links_hold():
    text = README.read_text()
    assert "make run" in text and "make test" in text and "make test-all" in text
    makefile = (REPO / "Makefile").read_text()
    for target in ("run", "test", "test-all", "docs", "docs-serve", "docs-ref"):
        assert re.search(rf"^{re.escape(target)}:", makefile, re.M), target
    assert "jobs/configs/quickstart.toml" in makefile and (REPO / "jobs/configs/quickstart.toml").is_file()
    # A user's clone has only the repository: no link may leave it.
    assert "../shared" not in text
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text)
    assert links
    for link in links:
        if not link.startswith(("http://", "https://")):
            assert (REPO / link).is_file(), link


def test_the_api_guide_says_a_job_file_with_a_source_is_no_estimators_config(dask_client, tmp_path):
    """#46: an estimator refuses a config whose pipelines.source.format is not its own (the
    DataFrame is its source): the guide says so before a user meets the refusal."""
    import dask.dataframe as dd
    import pandas as pd

    from shardline.dask import ShardlineEstimator
    from shardline.foundation.errors import ConfigError

    job = tmp_path / "job.toml"
    job.write_text("[pipelines.source]\nformat = 'csv'\npath = 'raw/'\n")
    ddf = dd.from_pandas(pd.DataFrame({"x": [1.0, 2.0], "label": [0, 1]}), npartitions=1)
    with pytest.raises(ConfigError, match="pipelines.source.format = 'csv': an estimator's source is the DataFrame"):
        ShardlineEstimator(str(job), label_col="label", client=dask_client).fit(ddf)
    guide = " ".join((REPO / "docs" / "guide" / "api.md").read_text().split())
    assert "A job file is not an estimator's config as it is." in guide
    assert "a config that sets `pipelines.source.format` to anything but `parquet`" in guide
    assert list(tmp_path.iterdir()) == [job]  # refused before anything was written
