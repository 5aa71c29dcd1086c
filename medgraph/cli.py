"""The `medgraph` command line: one `_cmd_<name>` function per subcommand.

To add a subcommand, write `_cmd_<name>(args) -> int` and register its parser
in `_parser()`; `main` dispatches on the `handler` default each subparser sets.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from medgraph.llm.base import ChatModel
    from medgraph.methods.a2rag import GraphTokenizer
    from medgraph.methods.common import MethodResult
    from medgraph.storage import Warehouse


def _cmd_sample_release(args: argparse.Namespace) -> int:
    """Build the UMLS-format sample release and print what it holds."""
    from medgraph.umls.sample_release import build_sample_release

    summary = build_sample_release(args.out, profile=args.profile)
    for key, value in summary.as_metadata().items():
        print(f"{key}: {value}")
    return 0


def _cmd_status(args: argparse.Namespace) -> int:
    """Where the platform's state is and what it holds (printed at the end of `make demo`)."""
    from medgraph.settings import load_settings, redact_uri
    from medgraph.storage import open_warehouse

    settings = load_settings()
    warehouse = open_warehouse(settings)
    print(f"MEDGRAPH_HOME      {settings.home}")
    print(f"UMLS release       {redact_uri(str(settings.umls_dir or settings.sample_release_dir))} "
          f"({'MEDGRAPH_UMLS_DIR' if settings.umls_dir else 'sample, profile ' + settings.profile})")
    print(f"warehouse          {warehouse.path}")
    if not warehouse.path.exists():
        print("                   (not built yet: run `make demo`)")
        return 1
    with warehouse.connect(read_only=True) as con:
        tables = con.execute(
            "SELECT table_schema, table_name FROM information_schema.tables "
            "WHERE table_schema NOT IN ('information_schema', 'pg_catalog') AND table_schema NOT LIKE 'fts_%' "
            "ORDER BY 1, 2").fetchall()
        for schema, table in tables:
            rows = con.execute(f'SELECT count(*) FROM "{schema}"."{table}"').fetchone()[0]
            print(f"  {schema + '.' + table:<40}{rows:>12,} rows")
    print(f"lake               {redact_uri(settings.lake_location)}")
    if settings.s3_endpoint_url:
        print(f"S3 endpoint        {redact_uri(settings.s3_endpoint_url)}")
    print(f"MLflow             {redact_uri(settings.mlflow_tracking_uri)}")
    print("Dagster UI         make ui   (then open http://127.0.0.1:3000)")
    return 0


def _parse_options(pairs: Sequence[str]) -> dict[str, str]:
    """`--option A="text"` values -> {"A": "text"}; letters are upper-cased and must be unique."""
    options: dict[str, str] = {}
    for pair in pairs:
        letter, sep, text = pair.partition("=")
        letter = letter.strip().upper()
        if not sep or not letter or not text.strip():
            raise SystemExit(f"medgraph ask: --option takes LETTER=TEXT, got {pair!r}")
        if letter in options:
            raise SystemExit(f"medgraph ask: option {letter} given twice")
        options[letter] = text.strip()
    return options


def _parse_overrides(pairs: Sequence[str]) -> dict[str, object]:
    """`--set key=value` values; a value is read as JSON when it can be (numbers, booleans, lists)."""
    overrides: dict[str, object] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key.strip():
            raise SystemExit(f"medgraph ask: --set takes KEY=VALUE, got {pair!r}")
        try:
            overrides[key.strip()] = json.loads(value)
        except json.JSONDecodeError:
            overrides[key.strip()] = value
        if isinstance(overrides[key.strip()], list):
            overrides[key.strip()] = tuple(overrides[key.strip()])
    return overrides


def _champion_graph_tokenizer(llm: ChatModel, warehouse: Warehouse) -> GraphTokenizer | None:
    """HIIM's graph tokenizer when a projector for this LLM is registered; None means text-only."""
    try:
        from medgraph.gnn.graph_tokens import load_champion_graph_tokenizer
    except ImportError:
        return None
    try:
        return load_champion_graph_tokenizer(llm, warehouse)
    except Exception as error:  # noqa: BLE001 - a broken registry must not stop a question being answered
        print(f"medgraph ask: HIIM graph tokens unavailable ({error}); answering text-only", file=sys.stderr)
        return None


def _print_trace(result: MethodResult) -> None:
    """Every step of the run, readable: action, arguments, what was retrieved, the model's output, cost."""
    from rich.console import Console
    from rich.panel import Panel
    from rich.table import Table
    from rich.text import Text

    console = Console()
    for step in result.steps:
        body = Text()
        if step.arguments:
            body.append("arguments  ", style="bold")
            body.append(json.dumps(step.arguments, ensure_ascii=False, default=str) + "\n")
        if step.retrieved_ids:
            shown = ", ".join(step.retrieved_ids[:8]) + (" ..." if len(step.retrieved_ids) > 8 else "")
            body.append("retrieved  ", style="bold")
            body.append(f"{len(step.retrieved_ids)}: {shown}\n")
        if step.output:
            body.append("output\n", style="bold")
            body.append(step.output.strip() + "\n")
        if step.observation:
            shown = step.observation if len(step.observation) <= 1500 else step.observation[:1500] + " ..."
            body.append("observation\n", style="bold cyan")
            body.append(shown.strip() + "\n")
        if step.notes:
            body.append("note  ", style="bold yellow")
            body.append(step.notes + "\n")
        cost = f"{step.prompt_tokens} prompt + {step.completion_tokens} completion tokens, {step.latency_s:.2f}s"
        console.print(Panel(body, title=f"step {step.index}: {step.action}", subtitle=cost, title_align="left"))
    stats = Table(title=f"{result.method} statistics", show_header=False)
    for key, value in result.stats.items():
        stats.add_row(key, json.dumps(value, default=str) if not isinstance(value, str) else value)
    console.print(stats)


def _cmd_ask(args: argparse.Namespace) -> int:
    """Answer one question with one method over the warehouse's KG and corpus; optionally show the trace."""
    from medgraph.embed.encoder import load_encoder
    from medgraph.kg.qa import QaItem
    from medgraph.llm import load_llm
    from medgraph.methods import make_config, method_of, run_method
    from medgraph.retrieval import Retriever
    from medgraph.settings import load_settings
    from medgraph.storage import open_warehouse

    settings = load_settings()
    warehouse = open_warehouse(settings)
    if not warehouse.path.exists():
        print(f"no warehouse at {warehouse.path}: build the platform first (`make demo`)", file=sys.stderr)
        return 1
    item = QaItem(dataset="ask", qid="ask", question=args.question, options=_parse_options(args.option), answer="")
    try:
        config = make_config(args.method, _parse_overrides(args.set))
    except (ValueError, TypeError) as error:
        print(f"medgraph ask: {error}", file=sys.stderr)
        return 2
    llm = None
    if method_of(args.method) == "graph-r1" and args.llm is None:
        llm = _champion_policy(settings, args.method)  # as evaluation picks it: GRPO, else SFT, else the base LLM
    llm = llm or load_llm(args.llm)
    graph_tokenizer = _champion_graph_tokenizer(llm, warehouse) if method_of(args.method) == "a2rag" else None
    with Retriever(warehouse, load_encoder(settings.encoder)) as retriever:
        (result,) = run_method(args.method, [item], retriever, llm, config, graph_tokenizer=graph_tokenizer)
    llm.close()
    if args.json:
        payload = {k: v for k, v in result.as_dict().items() if k not in ("answer", "correct", "f1")}
        print(json.dumps(payload, ensure_ascii=False, indent=1, default=str))
        return 0
    if args.trace:
        _print_trace(result)
    if result.prediction is None:
        print("answer: (none: the model's reply could not be parsed)")
        return 2
    text = item.options.get(result.prediction)
    print(f"answer: {result.prediction}" + (f". {text}" if text else ""))
    return 0


def _champion_policy(settings: object, method: str):  # -> ChatModel | None
    """The policy evaluation would run `method` with (the GRPO champion, else the SFT champion), or None for the
    base LLM; says which on stderr."""
    try:
        from medgraph.rl.policy import choose_policy, load_chosen_policy
    except ImportError:
        return None
    choice = choose_policy(method, tracking_uri=settings.mlflow_tracking_uri, home=settings.home)
    if choice.source is None:  # e.g. graph-r1-sft-only without a registered SFT policy: never run the base LLM instead
        print(f"medgraph ask: {method} {choice.description}", file=sys.stderr)
        raise SystemExit(2)
    print(f"policy: {choice.description}", file=sys.stderr)
    return load_chosen_policy(choice, tracking_uri=settings.mlflow_tracking_uri, home=settings.home)


def _cmd_models(args: argparse.Namespace) -> int:
    """Registered models: `list` (every model, its champion and latest version) or `show NAME[@ALIAS|/VERSION]`."""
    from mlflow.exceptions import MlflowException

    from medgraph.settings import load_settings, redact_uri
    from medgraph.tracking import Tracking

    settings = load_settings()
    tracking = Tracking(settings.mlflow_tracking_uri, str(settings.home / "artifacts"))
    shown_uri = redact_uri(tracking.tracking_uri)
    client = tracking.client
    if args.action == "list":
        models = client.search_registered_models()
        if not models:
            print(f"no registered models in {shown_uri} (run `make demo`)")
            return 1
        print(f"{'model':<28} {'champion':>9} {'latest':>7}  tracking URI {shown_uri}")
        for model in sorted(models, key=lambda m: m.name):
            champion = tracking.champion_version(model.name)
            latest = max((int(v.version) for v in client.search_model_versions(f"name='{model.name}'")), default=0)
            print(f"{model.name:<28} {'v' + champion if champion else '-':>9} {'v' + str(latest):>7}")
        return 0
    name, _, alias = args.model.partition("@")
    name, _, version = name.partition("/")
    try:
        if version:
            found = client.get_model_version(name, version)
        else:
            found = client.get_model_version_by_alias(name, alias or "champion")
    except MlflowException as error:
        print(redact_uri(f"{args.model}: not found in {shown_uri} ({error})"))
        return 1
    run = client.get_run(found.run_id)
    print(f"{name} v{found.version}  aliases: {', '.join(found.aliases) or '-'}")
    print(f"  run        {found.run_id} (experiment {run.info.experiment_id}, {run.info.status})")
    print(f"  source     {found.source}")
    for key in sorted(found.tags):
        print(f"  tag        {key} = {found.tags[key]}")
    lineage = {k: v for k, v in run.data.tags.items() if k.startswith(("data_version/", "dagster/", "lineage/"))}
    for key in sorted(lineage):
        print(f"  lineage    {key} = {lineage[key]}")
    for key in sorted(run.data.metrics):
        print(f"  metric     {key} = {run.data.metrics[key]:.4g}")
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="medgraph", description="MedGraph: UMLS knowledge graph and GraphRAG.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    sample = commands.add_parser(
        "sample-release", help="write a UMLS-format sample release built from HPO, ICD-10-CM and a drug table")
    sample.add_argument("--out", required=True, help="directory to write the RRF files into (replaced atomically)")
    sample.add_argument("--profile", choices=("tiny", "demo", "broad"), default="tiny",
                        help="tiny: ~2.7k concepts for tests; demo: ~7k (make demo); broad: ~50k (default: tiny)")
    sample.set_defaults(handler=_cmd_sample_release)

    status = commands.add_parser("status", help="show where the state is (MEDGRAPH_HOME) and the tables it holds")
    status.set_defaults(handler=_cmd_status)

    ask = commands.add_parser("ask", help="answer one question with a method and show its trace")
    ask.add_argument("question", help="the question text")
    ask.add_argument("--option", action="append", default=[], metavar='LETTER="TEXT"',
                     help='a multiple-choice option, e.g. --option A="amlodipine" (repeat; none: short answer)')
    ask.add_argument("--method", default="a2rag",
                     help="a2rag, graph-r1, sema-rag, cot, rag, rag-kg, irag, or a named ablation such as a2rag-no-gsrm "
                          "(medgraph.methods.ABLATIONS); default: a2rag")
    ask.add_argument("--llm", default=None, help="LLM spec (default: MEDGRAPH_LLM, smollm2-135m-instruct)")
    ask.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                     help="a method configuration field, e.g. --set tau=0.6 --set max_steps=3 (repeat)")
    ask.add_argument("--trace", action="store_true", help="print the step-by-step trace")
    ask.add_argument("--json", action="store_true", help="print the result (trace included) as JSON")
    ask.set_defaults(handler=_cmd_ask)

    models = commands.add_parser("models", help="registered models: list, or show NAME[@ALIAS|/VERSION]")
    model_actions = models.add_subparsers(dest="action", required=True, metavar="ACTION")
    model_actions.add_parser("list", help="every registered model with its champion and latest version")
    show = model_actions.add_parser("show", help="one version: metrics, run, data lineage (default alias: champion)")
    show.add_argument("model", help="e.g. medgraph-gat, medgraph-gat@champion, medgraph-gat/3")
    models.set_defaults(handler=_cmd_models)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `medgraph` console script; returns the exit status."""
    args = _parser().parse_args(argv)
    return int(args.handler(args))


if __name__ == "__main__":
    raise SystemExit(main())
