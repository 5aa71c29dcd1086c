"""A2RAG, the Graph-R1 agent, SEMA-RAG and the baselines, run through one lockstep agent loop.

`run_method(name, items, retriever, llm)` answers questions with a method or a
named ablation and returns one `MethodResult` (prediction, score, trace,
statistics) per question; `trace_rows` flattens the traces into table rows.
"""

from medgraph.methods.common import MethodResult, Step, parse_answer, score_answer, trace_rows
from medgraph.methods.registry import ABLATIONS, METHODS, build_method, make_config, method_of, run_method
from medgraph.methods.tools import KnowledgeTools

__all__ = [
    "ABLATIONS", "METHODS", "KnowledgeTools", "MethodResult", "Step", "build_method", "make_config", "method_of",
    "parse_answer", "run_method", "score_answer", "trace_rows",
]
