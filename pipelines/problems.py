"""What prepare refuses once its tasks have read the data, worded as one line each.

The first problem of pass 1's report of a kind the settings make fatal (a value that does
not parse, a null key or label, a label outside the classes, an invalid feature, a tensor
or image its declaration refuses), the input's having no rows, and the first key pass 2
met twice. pipelines.checks words the tensors and images it checks on the driver with
`typed_problem` too, so a problem reads the same whether the driver or a task found it.
"""

from __future__ import annotations

from .config import FeatureSpec, PipelineConfig
from shardline.foundation.errors import DataError
from .raw import Unit
from .rows import BAD_KINDS, INVALID
from .sources import display
from .tasks import first_problem

_WHAT = {
    "bad": "value does not parse as the column's type (pipelines.source.on_bad_rows = 'drop' skips such rows)",
    "null_key": "key is null",
    "null_label": "label is null",
    "negative_label": "class label is negative (classes are 0..K-1)",
    INVALID: "feature is NaN, inf or null (pipelines.features.on_invalid_features = 'impute' fills it)",
    "bad_image": "not a decodable PNG or JPEG image",
}
_DROP = " (pipelines.source.on_bad_rows = 'drop' skips such rows)"


def typed_problem(kind: str, col: str, spec: FeatureSpec) -> str | None:
    """What is wrong with a tensor or image value, from its declaration."""
    if col in spec.tensors:
        t = spec.tensors[col]
        if kind == "bad_shape":
            return f"tensor's shape differs from the declared {t.shape}{_DROP}"
        if kind == "bad_dtype":
            return f"tensor's values do not fit the declared dtype {t.dtype}{_DROP}"
        if kind == "out_of_vocab":
            return f"token id outside the vocabulary 0..{t.vocab_size - 1} (vocab_size = {t.vocab_size}){_DROP}"
    if col in spec.images:
        c, h, w = spec.images[col].shape
        if kind == "bad_image":
            return f"{_WHAT[kind]}{_DROP}"
        if kind == "image_size":
            return (f"image is not {h}x{w} (height x width) and pipelines.features.images.{col}.resize "
                    f"is off{_DROP}")
    return None


def check_report(report: dict, cfg: PipelineConfig, spec: FeatureSpec, num_classes: int | None,
                 frozen: bool) -> None:
    """The first problem in file and row order, of the kinds the settings make fatal."""
    if "error" in report:
        raise DataError(report["error"])
    kinds = list(BAD_KINDS) if cfg.source.on_bad_rows == "fail" else []
    if spec.on_invalid_features == "fail":
        kinds.append(INVALID)
    first = first_problem(report, kinds)
    if first is not None:
        kind, col, p = first
        if kind == "unknown_label":
            what = (
                f"label is not one of the classes {spec.class_names}" if spec.class_names is not None
                else f"label is outside the dataset's {num_classes} classes 0..{num_classes - 1}" if frozen
                and spec.classes is None
                else f"label is outside pipelines.features.classes = {num_classes} (0..{num_classes - 1})"
            )
        else:
            what = typed_problem(kind, col, spec) or _WHAT[kind]
        raise DataError(
            f"{display(p['file'])}: column '{col}', key {p['key']!r}: value {p['value']!r}: "
            f"{what} ({report['fatal_rows']} bad row(s) in all)"
        )
    total = sum(report["rows"])
    if total == 0:
        extra = f" after dropping {report['dropped']} bad row(s)" if report["dropped"] else ""
        raise DataError(f"{display(cfg.source.path)}: input has no rows{extra}")
    if report["rows"][0] == 0:
        raise DataError(f"{display(cfg.source.path)}: no row falls in the train split")


def check_repeats(metas: list[dict], units: list[Unit], existing: list[str], spec: FeatureSpec) -> None:
    """A key seen twice (with on_bad_rows = 'fail'): the repeat met first in unit and row order."""
    repeats = [m for m in metas if m["repeat_key"] is not None]
    if not repeats:
        return
    m = min(repeats, key=lambda m: m["repeat_pos"])

    def file_of(pos: int) -> str:
        index = pos >> 32
        return display(units[index].url if index >= 0 else existing[index])

    files = sorted({file_of(m["first_pos"]), file_of(m["repeat_pos"])})
    raise DataError(
        f"{', '.join(files)}: duplicate key {m['repeat_key']} in column '{spec.key}' "
        f"(pipelines.source.on_bad_rows = 'drop' keeps its first row)"
    )
