"""Dagster resources: one per external system, each a thin shell over medgraph/."""

from resources.warehouse import UmlsReleaseResource, WarehouseResource, build_resources

__all__ = ["UmlsReleaseResource", "WarehouseResource", "build_resources"]
