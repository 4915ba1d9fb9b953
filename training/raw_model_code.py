"""The registered model's entry point: MLflow runs this file to load the model ("models
from code"), where it would otherwise unpickle a python_model. See training.raw_model."""

import mlflow

from shardline.training.raw_model import RawRowsModel

mlflow.models.set_model(RawRowsModel())
