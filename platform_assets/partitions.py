"""The benchmark datasets as the evaluation assets' static partitions, shared by the assets and the sensors.

Named once here, from MEDGRAPH_BENCHMARK alone: no benchmark file is opened while the definitions load (a MIRAGE
file without `#names` gives MIRAGE's five datasets, a JSONL file its stem). Never raises: a bad benchmark fails
inside eval/qa_benchmark, not while the definitions load.
"""

import dagster as dg

from medgraph.qa.benchmarks import partition_names
from medgraph.settings import load_settings

_SETTINGS = load_settings()
BENCHMARK = _SETTINGS.benchmark
DATASETS = dg.StaticPartitionsDefinition(partition_names(BENCHMARK, _SETTINGS.home))
