"""Sensors: a new or changed UMLS release requests ingestion (registry sensors join with the evaluations)."""

import dagster as dg

from sensors.release import umls_release_sensor

defs = dg.Definitions(sensors=[umls_release_sensor])
