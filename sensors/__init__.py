"""Sensors: a new or changed UMLS release requests ingestion; a new champion requests re-evaluation."""

import dagster as dg

from sensors.registry import champion_sensor
from sensors.release import umls_release_sensor

defs = dg.Definitions(sensors=[umls_release_sensor, champion_sensor])
