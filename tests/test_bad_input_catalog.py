"""The bad-input catalog (#16 item 10): one table of a user's mistakes, each run through the
real CLI (`jobs.cli.main`, in this process: no engine may start, so none is paid for),
checked for its exit code, its one line naming what is wrong, and that nothing was
written (the case's folder holds only what the case put there) or lost (the prepared
dataset and any checkpoints are byte-for-byte as before).

The cases live in tests/bad_input_cases.py, which the reference page
docs/reference/errors.md is generated from (`python docs/gen_ref.py`); tests/test_docs.py
checks the committed page is current.
"""

from __future__ import annotations

from contextlib import ExitStack
from pathlib import Path

import pytest

from shardline.foundation.object_stores import forget_clients
from shardline.jobs.cli import main

from .bad_input_cases import CASES, Case
from .conftest import REPO
from .defaults_helpers import FEATURES, small_dataset, tree  # noqa: F401 (a fixture)


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
    for k, v in (case.env or {}).items():
        monkeypatch.setenv(k, v)
    with ExitStack() as stack:
        if case.env:  # clients made from the case's environment, dropped after it
            forget_clients()
            stack.callback(forget_clients)
        held = case.setup(folder, dataset) if case.setup else None
        if held is not None:
            stack.enter_context(held)
        before = tree(folder)
        monkeypatch.chdir(folder)
        args = [a.format(cfg=folder / "job.toml", dir=folder, dataset=dataset) for a in case.args]
        with pytest.raises(SystemExit) as exit_:
            main(args)
        err = capsys.readouterr().err
        assert exit_.value.code == case.code, err
        lines = [ln for ln in err.strip().splitlines() if ln.strip()]
        # One line (click's usage errors add a "Usage:" and a "Try" line around theirs; no other).
        errors = [ln for ln in lines if not (case.usage and ln.startswith(("Usage:", "Try ")))]
        assert len(errors) == 1 and case.message in errors[0], err
        assert "secret" not in err  # a password in a store's URL is never printed
        # Nothing written, nothing lost: the checkpoints, the output and the MLflow store
        # (tracking_uri is a SQLite file in the folder: no run, not even the file, is made).
        assert tree(folder) == before
    assert tree(Path(dataset)) == data_before


def test_the_catalog_is_large_and_covers_every_exit_code():
    assert len(CASES) >= 30
    assert {c.code for c in CASES} == {1, 2, 75}


def test_the_reference_page_lists_the_catalog():
    text = (REPO / "docs" / "reference" / "errors.md").read_text()
    table = text.split("## Bad-input catalog", 1)[1]
    for c in CASES:
        row = f"| {c.what} | `shardline {c.args[0]}` | {c.code} | {c.message} |"
        assert row in table, row
