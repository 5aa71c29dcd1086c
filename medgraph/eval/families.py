"""The evaluation families: which methods each evaluation asset runs, what each needs, and one run of a family.

An `EvalFamily` is a small spec (its methods, the model assets it reads, whether it loads HIIM's graph tokens
or GSRM's tuned parameters); `platform_assets/evaluation.py` declares one asset per family from it. A run
(`plan_family` then `run_family`) chooses the models by MLflow alias, merges the settings (a trained policy's
environment, the tuned GSRM parameters, then the run's own `method_config`), records the lineage, and answers
every (reader, method) row or says why it was skipped.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from medgraph.eval.gsrm import read_gsrm_params, with_tuned_gsrm
from medgraph.eval.readers import READERS, base_reader_only, load_adapted_reader, reader_label
from medgraph.gnn.graph_tokens import GraphTokenizer, load_champion_graph_tokenizer
from medgraph.llm.base import ChatModel
from medgraph.methods.common import MethodResult
from medgraph.methods.registry import make_config, method_of, run_method
from medgraph.methods.tools import KnowledgeTools
from medgraph.qa.item import QaItem
from medgraph.rl.policy import PolicyChoice, choose_policy, load_chosen_policy, policy_environment
from medgraph.storage import Warehouse
from medgraph.tracking import Tracking


class UnknownReaderError(ValueError):
    """A run asked for a reader that is not one of `READERS`."""


@dataclass(frozen=True)
class EvalFamily:
    name: str  # the asset's name, eval/<name>; its tables are eval.<name>_results, _traces, _summary
    methods: tuple[str, ...]  # what it runs by default (a run config may name others, or ablations)
    models: tuple[str, ...]  # the model assets it reads (models/<name>), for lineage and automation
    description: str
    graph_tokens: bool = False  # A2RAG's HIIM: the champion projector and the GAT it was trained with
    tuned_gsrm: bool = False  # GSRM's tau, K, N as models/gsrm_params chose them on validation


FAMILIES: tuple[EvalFamily, ...] = (
    EvalFamily("eval_baselines", ("cot", "rag", "rag-kg", "irag", "oracle-evidence"), ("reader_adapter",),
               "Baselines: chain of thought; MedRAG (text snippets, BM25 + dense, RRF); rag-kg, our variant with "
               "KG triples; i-MedRAG (follow-up queries, each answered from its snippets); oracle-evidence, the "
               "reader's ceiling (the gold facts and wrong-relation triples of the same concepts)."),
    EvalFamily("eval_a2rag", ("a2rag",), ("gat_model", "hiim_projector", "gsrm_params", "reader_adapter"),
               "A2RAG (AWC + GSRM + HIIM with the champion projector, text-only fallback recorded).",
               graph_tokens=True, tuned_gsrm=True),
    EvalFamily("eval_graph_r1", ("graph-r1",), ("graph_r1_sft", "graph_r1_policy"),
               "The Graph-R1 agent driven by the GRPO champion, else the SFT champion, else the base LLM (said in "
               "its lineage); ablations graph-r1-no-sft (base LLM) and graph-r1-sft-only."),
    EvalFamily("eval_sema_rag", ("sema-rag",), ("reader_adapter",),
               "SEMA-RAG (I-Agent schema, E-Agent sufficiency loop, A-Agent evidence report)."),
)


def load_policies(methods: Sequence[str],
                  tracking: Tracking) -> tuple[dict[str, tuple[PolicyChoice, ChatModel | None]], dict[str, object]]:
    """Graph-R1 method or ablation -> (PolicyChoice, its chat model or None for the base LLM): `graph-r1`
    the GRPO champion, else the SFT champion, else the base LLM; `graph-r1-sft-only` the SFT champion or
    nothing (choice.source None: skipped); `graph-r1-no-sft` the base LLM. Each model is loaded once.
    Also the environment every Graph-R1 variant runs in: the one `graph-r1`'s policy (else the first
    trained one) learned in, so the ablations are paired with it in the same environment."""
    loaded: dict[str | None, ChatModel | None] = {None: None}
    policies = {}
    for method in (m for m in methods if method_of(m) == "graph-r1"):
        choice = choose_policy(method, tracking)
        if choice.model_uri not in loaded:
            loaded[choice.model_uri] = load_chosen_policy(choice, tracking)
        policies[method] = (choice, loaded[choice.model_uri])
    trained = sorted((m != "graph-r1", c.model_uri) for m, (c, _) in policies.items() if c.model_uri)
    environment = policy_environment(trained[0][1], tracking) if trained else {}
    return policies, environment


@dataclass
class FamilyPlan:
    """What one run of a family will use: decided before anything is answered, so its lineage can be logged first."""

    family: EvalFamily
    methods: tuple[str, ...]
    readers: tuple[str, ...]
    llm: ChatModel
    overrides: dict[str, dict[str, object]]
    lineage: dict[str, object]
    policies: dict[str, tuple[PolicyChoice, ChatModel | None]] = field(default_factory=dict)
    adapted: ChatModel | None = None
    adapted_source: str = ""
    graph_tokenizer: GraphTokenizer | None = None


class EvalRequestError(ValueError):
    """An evaluation's run config asks for something it cannot mean (the message names the field)."""


@dataclass(frozen=True)
class EvalRequest:
    """An evaluation asset's run config, checked: what to run, on how many questions, with which overrides."""

    methods: tuple[str, ...]
    limit: int | None
    overrides: dict[str, dict[str, object]]


def checked_eval_request(family: EvalFamily, methods: Sequence[str] | None, limit: int | None,
                         method_config: str) -> EvalRequest:
    """The run config's `methods`, `limit` and `method_config`, or EvalRequestError saying which is wrong and why:
    a limit below 1 (a negative slice would drop questions silently), an empty method list (it would run the
    family's defaults), an unknown method or one of another family (its rows would land in this family's tables),
    or a method_config that is not a JSON object of known methods and their known fields."""
    if limit is not None and limit < 1:
        raise EvalRequestError(f"{family.name}: limit must be at least 1 (the first N questions), or unset for all; "
                               f"got {limit}")
    if methods is not None and not methods:
        raise EvalRequestError(f"{family.name}: methods is empty; name at least one, or leave it unset for "
                               f"{', '.join(family.methods)}")
    chosen = tuple(methods or family.methods)
    own = {method_of(m) for m in family.methods}
    for name in chosen:
        try:
            make_config(name)
        except ValueError as error:  # an unknown name, listing the known ones
            raise EvalRequestError(f"{family.name}: methods: {error}") from None
    foreign = [m for m in chosen if method_of(m) not in own]
    if foreign:
        raise EvalRequestError(f"{family.name}: {', '.join(foreign)} not of this family (it runs "
                               f"{', '.join(sorted(own))} and their ablations); evaluate them with their own asset")
    try:
        overrides = json.loads(method_config)
    except json.JSONDecodeError as error:
        raise EvalRequestError(f"{family.name}: method_config is not JSON ({error.msg} at column {error.colno}); "
                               'expected an object such as {"a2rag": {"tau": 0.4}}') from None
    if not isinstance(overrides, dict) or not all(isinstance(v, dict) for v in overrides.values()):
        raise EvalRequestError(f"{family.name}: method_config must be a JSON object of method name -> object of "
                               f'fields, such as {{"a2rag": {{"tau": 0.4}}}}; got {method_config!r}')
    for name, fields in overrides.items():
        try:
            make_config(name, fields)
        except (ValueError, TypeError) as error:  # an unknown method or field, listing the known ones
            raise EvalRequestError(f"{family.name}: method_config: {error}") from None
    return EvalRequest(chosen, limit, overrides)


def plan_family(family: EvalFamily, llm: ChatModel, store: Warehouse, tracking: Tracking, home: Path, *,
                encoder_id: str, methods: Sequence[str] | None = None, readers: Sequence[str] = ("base",),
                overrides: Mapping[str, Mapping[str, object]] | None = None) -> FamilyPlan:
    """The models, settings and lineage of one run of `family` (its own methods unless `methods` names others).
    `overrides` (the run's method_config) win over a trained policy's environment and GSRM's tuned values."""
    unknown = set(readers) - set(READERS)
    if unknown:
        raise UnknownReaderError(f"unknown readers {sorted(unknown)}: {', '.join(READERS)}")
    methods = tuple(methods or family.methods)
    merged = {name: dict(values) for name, values in (overrides or {}).items()}
    graph_tokenizer = load_champion_graph_tokenizer(llm, store, tracking) if family.graph_tokens else None
    policies, environment = load_policies(methods, tracking)
    adapted, adapted_source = load_adapted_reader(tracking) if "adapted" in readers else (None, "")
    lineage: dict[str, object] = {"llm": llm.name, "encoder": encoder_id,
               "readers": ", ".join(readers) + (f" (adapted: {adapted_source})" if adapted_source else ""),
               "hiim": "graph-tokens" if graph_tokenizer is not None else "text-only",
               "graph_r1_policy": "; ".join(f"{m}: {c.description}" for m, (c, _) in policies.items()) or "n/a"}
    if environment:  # the trained policy's environment; method_config still wins
        merged = {m: {**environment, **merged.get(m, {})} if m in policies else merged.get(m, {})
                  for m in {*merged, *policies}}
        lineage["graph_r1_environment"] = (
            ", ".join(f"{k}={v}" for k, v in sorted(environment.items()))
            + " (the environment the policy was trained in, not the design's 10 steps and ~500-token analyze: "
              "a policy is evaluated where it learned; the CPU profiles train in a smaller one for speed)")
    if family.tuned_gsrm:  # tau, K, N tuned on validation by models/gsrm_params; method_config still wins
        merged, gsrm_lineage = with_tuned_gsrm(read_gsrm_params(home), methods, merged)
        lineage.update(gsrm_lineage)
    return FamilyPlan(family, methods, tuple(readers), llm, merged, lineage, policies, adapted, adapted_source,
                      graph_tokenizer)


# An `@adapted` row is a comparison only where the adapter answers the method's call in form: above this share of
# validation questions asked again (no readable answer), the row would measure the forced retry, not the reader.
MAX_ADAPTED_ASKED_AGAIN = 0.10


def run_family(plan: FamilyPlan, items: Sequence[QaItem], tools: KnowledgeTools, *, batch_size: int,
               log: Callable[[str], None] = print, warn: Callable[[str], None] = print,
               dataset: str = "", probe_items: Sequence[QaItem] = ()) -> list[MethodResult]:
    """Every (reader, method) row of the plan on `items`, labelled `<method>` or `<method>@adapted`; a row that
    cannot run (an SFT-only ablation without an SFT champion, an adapted row without an adapter or for a method
    that keeps the base reader) is skipped with a warning that says why. With `probe_items` (validation
    questions of the same dataset) each `@adapted` row answers them first and runs on `items` only if at most
    `MAX_ADAPTED_ASKED_AGAIN` of them were asked again; each probe's outcome is in `plan.lineage["adapted_probe"]`."""
    results = []
    probes: list[str] = []
    for reader_name in plan.readers:
        for method in plan.methods:
            choice, policy = plan.policies.get(method, (None, None))
            if choice is not None and choice.source is None:  # e.g. SFT-only without an SFT champion
                warn(f"{method} on {dataset}: {choice.description}")
                continue
            label = reader_label(method, reader_name)
            reader = plan.adapted if reader_name == "adapted" else None
            why_not = base_reader_only(method) if reader_name == "adapted" else None
            if reader_name == "adapted" and (reader is None or why_not):
                warn(f"{label} on {dataset}: not run: {why_not or plan.adapted_source}")
                continue
            model = policy if policy is not None else plan.llm
            config = make_config(method, plan.overrides.get(method))
            if reader is not None and probe_items:
                probe = run_method(method, probe_items, tools, model, config, batch_size=batch_size,
                                   graph_tokenizer=plan.graph_tokenizer, reader=reader)
                asked_again = sum(r.extra_answer_call for r in probe) / len(probe)
                runs = asked_again <= MAX_ADAPTED_ASKED_AGAIN
                probes.append(f"{label} {'runs' if runs else 'not run'}: asked again {asked_again:.2f} of "
                              f"{len(probe)} validation questions")
                if not runs:
                    warn(f"{label} on {dataset}: not run: asked again in {asked_again:.2f} of {len(probe)} "
                         f"validation questions (at most {MAX_ADAPTED_ASKED_AGAIN:.2f}): the adapter does not answer "
                         f"{method}'s call in form")
                    continue
            log(f"{label} on {dataset}: {len(items)} questions with {model.name}"
                + (f", answered by {reader.name}" if reader is not None else ""))
            answered = run_method(method, items, tools, model, config,
                                  batch_size=batch_size, graph_tokenizer=plan.graph_tokenizer, reader=reader)
            for result in answered:
                result.method = label
                if choice is not None:
                    result.stats.update(graph_r1_policy=choice.description, graph_r1_policy_source=choice.source)
            results += answered
    if probes:
        plan.lineage["adapted_probe"] = "; ".join(probes)
    return results
