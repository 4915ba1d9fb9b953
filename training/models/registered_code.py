"""The registered model's entry point: MLflow runs this file to load the model ("models
from code"), where it would otherwise unpickle a python_model. See training.models.registered."""

import mlflow

from shardline.training.models.registered import RawRowsModel

mlflow.models.set_model(RawRowsModel())
