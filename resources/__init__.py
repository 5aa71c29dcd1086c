"""Dagster resources: one per external system, each a thin shell over medgraph/."""

from resources.encoder import EncoderResource
from resources.llm import LlmResource
from resources.mlflow import MlflowResource
from resources.training import TrainingResource
from resources.warehouse import UmlsReleaseResource, WarehouseResource, build_resources

__all__ = ["EncoderResource", "LlmResource", "MlflowResource", "TrainingResource", "UmlsReleaseResource", "WarehouseResource",
           "build_resources"]
