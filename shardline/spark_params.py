"""The training settings a search tunes (shardline.hyperparams) as pyspark.ml Params of
the Spark estimator, so pyspark.ml's own tuning takes them:

    grid = ParamGridBuilder().addGrid(est.lr, [1e-3, 3e-3]).build()
    CrossValidator(estimator=est, estimatorParamMaps=grid, evaluator=...).fit(df)

Each is None by default (the config's value holds); set one with the estimator's keyword
(`lr=1e-3`), `est.set(est.lr, 1e-3)` or a param map (`est.fit(df, {est.lr: 1e-3})`).
"""

from __future__ import annotations

from pyspark.ml.param import Param, Params, TypeConverters

from .hyperparams import TUNED

_DOC = {t.spark: f"training.{t.name}: {t.doc} (default: the config's)" for t in TUNED}


def _dict_value(value):
    if not isinstance(value, dict):
        raise TypeError(f"modelArgs: a dict of the factory's keyword arguments, not {type(value).__name__}")
    return dict(value)


class HasTrainingParams(Params):
    model = Param(Params._dummy(), "model", _DOC["model"], typeConverter=TypeConverters.toString)
    modelArgs = Param(Params._dummy(), "modelArgs", _DOC["modelArgs"], typeConverter=_dict_value)
    hidden = Param(Params._dummy(), "hidden", _DOC["hidden"], typeConverter=TypeConverters.toListInt)
    strategy = Param(Params._dummy(), "strategy", _DOC["strategy"], typeConverter=TypeConverters.toString)
    epochs = Param(Params._dummy(), "epochs", _DOC["epochs"], typeConverter=TypeConverters.toInt)
    batchSize = Param(Params._dummy(), "batchSize", _DOC["batchSize"], typeConverter=TypeConverters.toInt)
    lr = Param(Params._dummy(), "lr", _DOC["lr"], typeConverter=TypeConverters.toFloat)
    weightDecay = Param(Params._dummy(), "weightDecay", _DOC["weightDecay"], typeConverter=TypeConverters.toFloat)
    lrSchedule = Param(Params._dummy(), "lrSchedule", _DOC["lrSchedule"], typeConverter=TypeConverters.toString)
    warmupSteps = Param(Params._dummy(), "warmupSteps", _DOC["warmupSteps"], typeConverter=TypeConverters.toInt)
    seed = Param(Params._dummy(), "seed", _DOC["seed"], typeConverter=TypeConverters.toInt)

    def _set_tuned(self, values: dict) -> None:
        """Each Param's default, None (the config's value), and the estimator's keywords (by
        Tuned.name) that are given."""
        self._setDefault(**{t.spark: None for t in TUNED})
        by_name = {t.name: t.spark for t in TUNED}
        self._set(**{by_name[k]: v for k, v in values.items() if v is not None})

    def tuned_values(self) -> dict:
        """{Tuned.name: value} of the Params that are not None."""
        return {t.name: self.getOrDefault(getattr(self, t.spark)) for t in TUNED}
