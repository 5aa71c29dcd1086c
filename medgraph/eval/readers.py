"""Who answers a method's answering call: the base LLM, or the reader adapted to read evidence (issue 29).

`run_method(reader=)` sends only the answering call to the reader; retrieval, routing, queries and agent turns
stay with the base LLM. Evaluation labels the adapted reader's results `<method>@adapted` (`rag@adapted`), and
the report pairs each with its base-reader row and with the same reader's reference.
"""

from __future__ import annotations

from medgraph.llm.base import ChatModel
from medgraph.methods.registry import make_config, method_of
from medgraph.tracking import READER_ADAPTER_MODEL, Tracking

READERS = ("base", "adapted")


def reader_label(name: str, reader: str) -> str:
    """The results label of a method or ablation answered by `reader`: `rag`, `rag@adapted`."""
    if reader not in READERS:
        raise ValueError(f"unknown reader {reader!r}: one of {', '.join(READERS)}")
    return name if reader == "base" else f"{name}@{reader}"


def split_reader(label: str) -> tuple[str, str]:
    """(method or ablation name, reader) of a results label: `rag@adapted` -> (`rag`, `adapted`)."""
    name, _, reader = label.partition("@")
    return name, reader or "base"


# The answering-call layout of each method the adapted reader is trained to read (`medgraph.rl.reader.LAYOUTS`,
# and its no-evidence examples for `cot`). Another method's answering call (i-MedRAG's query-answer pairs,
# SEMA-RAG's evidence report) is a layout it never saw: it answers none of them in form and is asked again.
ADAPTED_LAYOUTS = {"oracle-evidence": "kg_facts", "rag-kg": "rag_kg", "rag": "documents", "a2rag": "a2rag",
                   "cot": "no evidence"}


def base_reader_only(name: str) -> str | None:
    """Why a method or ablation runs with the base reader only, or None when the adapted reader can answer it."""
    method = method_of(name)
    if method == "graph-r1":
        return "Graph-R1's policy answers itself (the paper trains the agent that answers)"
    if method == "a2rag" and getattr(make_config(name), "use_hiim", False):
        return ("HIIM's graph tokens were fitted to the base reader (models/hiim_projector); "
                "a2rag-no-hiim@adapted is A2RAG's adapted-reader row")
    if method not in ADAPTED_LAYOUTS:
        return (f"the reader adapter is not trained on {method}'s answering call (its layouts: "
                f"{', '.join(sorted(set(ADAPTED_LAYOUTS.values())))})")
    return None


def load_adapted_reader(tracking: Tracking) -> tuple[ChatModel | None, str]:
    """The champion reader adapter as a chat model (None when none is registered) and a line saying which."""
    from medgraph.rl.policy import load_policy  # torch-heavy: only when the adapted reader is asked for

    version = tracking.champion_version(READER_ADAPTER_MODEL.name)
    if version is None:
        return None, f"no {READER_ADAPTER_MODEL.name}@champion (materialize models/reader_adapter)"
    uri = f"models:/{READER_ADAPTER_MODEL.name}/{version}"
    return load_policy(uri, tracking), uri
