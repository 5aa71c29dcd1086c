"""Sensors: new UMLS release, registry alias changes (added as their assets land)."""

import dagster as dg

defs = dg.Definitions()
