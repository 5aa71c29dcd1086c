"""Dagster assets, grouped by domain; each module is a thin layer over medgraph/."""
