"""The `medgraph` command line: one `_cmd_<name>` function per subcommand.

To add a subcommand, write `_cmd_<name>(args) -> int` and register its parser
in `_parser()`; `main` dispatches on the `handler` default each subparser sets.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import sys
import threading
import time
import types
import typing
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from medgraph.settings import DEFAULT_LLM

if TYPE_CHECKING:
    from medgraph.llm.base import ChatModel
    from medgraph.methods.a2rag import GraphTokenEncoder
    from medgraph.methods.common import MethodResult
    from medgraph.retrieval import Retriever
    from medgraph.settings import Settings
    from medgraph.storage import Warehouse

# `medgraph ask` limits: the whole call (model loading included) and the question's length.
# The default time limit scales with the method: what one four-option question took from the command line (model
# loading included) on a `make demo` home, 2 CPU cores and nothing else running, the default SmolLM2-135M
# (ASK_USUAL_S; see `ask_default_timeout`), times ASK_TIMEOUT_HEADROOM for a busy machine, and never below
# ASK_TIMEOUT_S. Graph-R1's is an earlier measurement of a policy that walks all its turns, 2 cores shared with
# other work (the demo's short SFT policy answers in 13 s).
ASK_TIMEOUT_S = 45.0
ASK_TIMEOUT_HEADROOM = 3.0
ASK_USUAL_S = {"cot": 8.0, "rag": 6.0, "rag-kg": 6.0, "irag": 37.0, "a2rag": 8.0, "graph-r1": 72.0, "sema-rag": 14.0}
MAX_QUESTION_CHARS = 8_000  # ~2k prompt tokens; MedQA's longest vignettes are ~1.5k characters
EXIT_TIMEOUT = 124  # as timeout(1)
# After SIGTERM/SIGINT the CLI unwinds (closing connections, discarding staging files); if that has not
# ended the process within this many seconds (a worker thread stuck in a request), it exits anyway.
EXIT_GRACE_S = 3.0


def printable(text: str) -> str:
    """`text` for a terminal: control characters (escape sequences that recolour, move the cursor or retitle the
    window among them) written as Python escapes, so model and user text cannot drive the terminal."""
    return "".join(c if c.isprintable() or c in "\n\t" else c.encode("unicode_escape").decode("ascii") for c in text)


class UsageError(Exception):
    """A bad command line (exit status 2, as argparse's own errors)."""


class AskTimedOut(BaseException):
    """`medgraph ask --timeout` ran out. A BaseException, so library code that catches Exception
    (retries, fallbacks) does not swallow it."""


def _registry_problem(error: BaseException) -> str | None:
    """What to say when the error is the SQLite MLflow registry's (damaged or locked), naming the file and the
    remedy; None for any other error. SQLAlchemy and MLflow wrap sqlite3's error, so the causes are searched."""
    import sqlite3

    from medgraph.settings import load_settings

    cause: BaseException | None = error
    while cause is not None and not isinstance(cause, sqlite3.DatabaseError):
        cause = getattr(cause, "orig", None) or cause.__cause__ or cause.__context__
    if cause is None:
        return None
    try:
        uri = load_settings().mlflow_tracking_uri
    except Exception:  # noqa: BLE001 - the settings' own error is not this one's explanation
        return None
    if not uri.startswith("sqlite:///"):
        return None
    path = uri.removeprefix("sqlite:///")
    reason = str(cause).splitlines()[0]
    if "locked" in reason:
        return (f"the MLflow registry {path} is locked by another process ({reason}): let the run that holds it "
                "(`make demo`, `dagster dev`, a training asset) finish, then try again")
    return (f"the MLflow registry {path} cannot be read ({reason}): move it aside (`mv {path} {path}.broken`) to "
            "start an empty registry, or restore it from a backup; the model files under the home's artifacts/ "
            "are untouched")


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
    from medgraph.storage import list_tables, open_warehouse

    settings = load_settings()
    warehouse = open_warehouse(settings)
    print(f"MEDGRAPH_HOME      {settings.home}")
    print(f"UMLS release       {redact_uri(str(settings.umls_dir or settings.sample_release_dir))} "
          f"({'MEDGRAPH_UMLS_DIR' if settings.umls_dir else 'sample, profile ' + settings.profile})")
    print(f"warehouse          {warehouse.path}")
    if not warehouse.path.exists():
        print("                   (not built yet: run `make demo`)")
        return 1
    import duckdb

    unreadable: list[str] = []
    with warehouse.connect(read_only=True) as con:
        for schema, table in list_tables(con):
            try:
                # Every value is read (a hash of each whole row): count(*) alone comes from Parquet footers and
                # calls a file whose middle is damaged fine.
                rows = con.execute(f'SELECT count(*), sum(hash(whole_row)) FROM "{schema}"."{table}" AS whole_row'
                                   ).fetchone()[0]
            except duckdb.Error as error:  # a damaged or missing lake file: say which, and list the others
                unreadable.append(_writer_asset(schema, table))
                reason = str(error).strip().splitlines()[0]
                print(f"  {schema + '.' + table:<40}{'unreadable':>12}: {redact_uri(reason)}")
                continue
            print(f"  {schema + '.' + table:<40}{rows:>12,} rows")
    print(f"lake               {redact_uri(settings.lake_location)}")
    if settings.s3_endpoint_url:
        print(f"S3 endpoint        {redact_uri(settings.s3_endpoint_url)}")
    print(f"MLflow             {redact_uri(settings.mlflow_tracking_uri)}")
    print("Dagster UI         make ui   (then open http://127.0.0.1:3000)")
    if unreadable:
        selection = " or ".join(f'key:"{asset}"' for asset in sorted(set(unreadable)))
        print(f"medgraph status: {len(unreadable)} table{' is' if len(unreadable) == 1 else 's are'} unreadable "
              f"(above): restore the file named, or materialize what writes it again (`dg launch -m definitions "
              f"--assets '{selection}'`); the other tables are fine", file=sys.stderr)
        return 1
    return 0


def _writer_asset(schema: str, table: str) -> str:
    """The asset key (a/b) that writes a warehouse table: `schema/table`, but an evaluation's results, summary and
    traces tables (and GSRM recall's items) are its family's (`eval.eval_a2rag_traces` -> eval/eval_a2rag)."""
    if schema == "eval":
        for suffix in ("_results", "_summary", "_traces", "_items"):
            if table.endswith(suffix):
                return f"{schema}/{table.removesuffix(suffix)}"
    return f"{schema}/{table}"


def _parse_options(pairs: Sequence[str]) -> dict[str, str]:
    """`--option A="text"` values -> {"A": "text"}; letters are upper-cased and must be unique."""
    options: dict[str, str] = {}
    for pair in pairs:
        letter, sep, text = pair.partition("=")
        letter = letter.strip().upper()
        if not sep or not letter or not text.strip():
            raise UsageError(f"--option takes LETTER=TEXT, got {pair!r}")
        if letter in options:
            raise UsageError(f"option {letter} given twice")
        options[letter] = text.strip()
    return options


def _parse_overrides(pairs: Sequence[str], config_type: type | None = None) -> dict[str, object]:
    """`--set key=value` values; a value is read as JSON when it can be (numbers, booleans, lists).

    With `config_type` (a method's configuration dataclass) each key must be one of its fields and each
    value of the field's type and range; anything else is a UsageError naming the key and what it takes."""
    overrides: dict[str, object] = {}
    fields = _config_fields(config_type) if config_type is not None else {}
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        key = key.strip()
        if not sep or not key:
            raise UsageError(f"--set takes KEY=VALUE, got {pair!r}")
        try:
            value: object = json.loads(raw)
        except json.JSONDecodeError:
            value = raw
        if isinstance(value, list):
            value = tuple(value)
        if config_type is not None:
            if key not in fields:
                raise UsageError(f"--set {pair}: {config_type.__name__} has no field {key!r}; "
                                 f"known: {', '.join(sorted(fields))}")
            value = _checked_value(key, raw, value, fields[key])
        overrides[key] = value
    return overrides


# Fields that must be at least 1 (budgets and counts that 0 would make meaningless); every other number
# must be at least 0; `tau` is a probability threshold.
_POSITIVE_FIELDS = frozenset({"max_new_tokens", "query_tokens", "query_answer_tokens", "max_steps", "max_rounds",
                              "top_n", "search_k"})
_FLOAT_RANGES = {"tau": (0.0, 1.0)}


def _config_fields(config_type: type) -> dict[str, object]:
    hints = typing.get_type_hints(config_type)
    return {f.name: hints[f.name] for f in dataclasses.fields(config_type)}


def _describe_type(kind: object) -> str:
    origin, args = typing.get_origin(kind), typing.get_args(kind)
    if origin is typing.Literal:
        return "one of " + ", ".join(repr(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        return " or ".join("null" if a is type(None) else _describe_type(a) for a in args)
    if origin is tuple:
        return f"a list of {_describe_type(args[0])}s (JSON, e.g. [\"a\", \"b\"], or a,b)"
    return {bool: "true or false", int: "an integer", float: "a number", str: "a string"}.get(kind, str(kind))


def _checked_value(key: str, raw: str, value: object, kind: object) -> object:
    """`value` as field `key` of type `kind` takes it, or a UsageError that says what it takes."""
    def bad(expected: str) -> UsageError:
        return UsageError(f"--set {key}={raw}: {key} takes {expected}, got {raw!r}")

    origin, args = typing.get_origin(kind), typing.get_args(kind)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        for option in (a for a in args if a is not type(None)):
            try:
                return _checked_value(key, raw, value, option)
            except UsageError:
                continue
        raise bad(_describe_type(kind))
    if origin is typing.Literal:
        if value not in args:
            raise bad(_describe_type(kind))
        return value
    if origin is tuple:
        items = tuple(p.strip() for p in value.split(",") if p.strip()) if isinstance(value, str) else value
        if not isinstance(items, tuple) or not all(isinstance(i, str) for i in items):
            raise bad(_describe_type(kind))
        return items
    if kind is bool:
        if not isinstance(value, bool):
            raise bad(_describe_type(kind))
        return value
    if kind is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise bad(_describe_type(kind))
        low = 1 if key in _POSITIVE_FIELDS else 0
        if value < low:
            raise UsageError(f"--set {key}={raw}: {key} must be an integer >= {low}, got {value}")
        return value
    if kind is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise bad(_describe_type(kind))
        low, high = _FLOAT_RANGES.get(key, (0.0, float("inf")))
        if not low <= value <= high:
            limits = f"between {low:g} and {high:g}" if high != float("inf") else f">= {low:g}"
            raise UsageError(f"--set {key}={raw}: {key} must be a number {limits}, got {value}")
        return float(value)
    if kind is str:
        if not isinstance(value, str):
            return raw  # e.g. a name that happens to parse as a number
        return value
    return value


def _champion_graph_tokenizer(llm: ChatModel, warehouse: Warehouse,
                              settings: Settings) -> tuple[GraphTokenEncoder | None, str]:
    """HIIM's graph tokenizer when a projector for this LLM is registered, else None (text-only) and why: not
    registered, for another LLM, or registered but unreadable (said on stderr too, with what to do)."""
    try:
        from medgraph.gnn.graph_tokens import champion_graph_tokenizer
        from medgraph.tracking import Tracking, limit_registry_waits
    except ImportError:
        return None, "HIIM is not installed"
    limit_registry_waits()
    try:
        return champion_graph_tokenizer(llm, warehouse, Tracking.from_settings(settings))
    except Exception as error:  # noqa: BLE001 - a broken registry must not stop a question being answered
        from medgraph.settings import redact_uri

        reason = f"the HIIM projector is registered but unreadable: {redact_uri(str(error))}"
        print(f"medgraph ask: HIIM graph tokens unavailable, answering text-only: {reason}", file=sys.stderr)
        return None, reason


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


def _read_question(args: argparse.Namespace) -> str:
    """The question from the argument, `--question-file PATH`, or standard input (`-` for either)."""
    if args.question is not None and args.question_file is not None:
        raise UsageError("give the question either as an argument or with --question-file, not both")
    source = args.question_file if args.question_file is not None else args.question
    if source is None:
        raise UsageError("no question: give it as an argument, with --question-file PATH, or as - to read it "
                         "from standard input")
    if source == "-":
        text = sys.stdin.read()
    elif args.question_file is not None:
        path = Path(args.question_file)
        try:
            text = path.read_text(encoding="utf-8")
        except FileNotFoundError:
            raise UsageError(f"--question-file {path}: no such file") from None
        except UnicodeDecodeError as error:
            raise UsageError(f"--question-file {path}: not UTF-8 (byte {error.start})") from None
        except OSError as error:
            raise UsageError(f"--question-file {path}: {error.strerror}") from None
    else:
        text = args.question
    text = text.strip()
    if not text:
        raise UsageError("the question is empty" + (" (standard input)" if source == "-" else
                                                    f" ({source})" if args.question_file else ""))
    return text


def _check_question_length(question: str, options: dict[str, str], limit: int) -> None:
    """Refuse a question (with its options) longer than `limit` characters (0: no limit): prompt size, and
    so time and memory, grow with it, and a pasted document is rarely what was meant."""
    size = len(question) + sum(len(text) for text in options.values())
    if limit and size > limit:
        what = "the question with its options" if options else "the question"
        raise UsageError(f"{what} is {size:,} characters, over the limit of {limit:,} (about {limit // 4:,} prompt "
                         f"tokens); raise it with --max-question-chars N (0: no limit)")


@contextmanager
def _time_limit(seconds: float) -> Iterator[None]:
    """Raise AskTimedOut in the main thread after `seconds` (0: no limit), wherever it is: loading a model,
    generating, or waiting on an LLM server (a blocked socket read is interrupted)."""
    if not seconds or threading.current_thread() is not threading.main_thread() or not hasattr(signal, "setitimer"):
        yield
        return

    def expire(signum: int, frame: object) -> None:
        raise AskTimedOut()

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


class _LazyEncoder:
    """The encoder, loaded on first use: a method without dense retrieval (cot) never waits for it. While it
    loads, `stage[0]` says so (the time limit's message names what was running)."""

    def __init__(self, load: Any, loading: str = "", stage: list[str] | None = None):
        self._load, self._encoder, self._loading, self._stage = load, None, loading, stage

    def __getattr__(self, name: str) -> Any:
        if self._encoder is None:
            previous = self._stage[0] if self._stage else None
            if self._stage:
                self._stage[0] = self._loading
            self._encoder = self._load()
            if self._stage:
                self._stage[0] = previous
        return getattr(self._encoder, name)


class _ClosesWarehouseWhileGenerating:
    """The LLM, with the retriever's warehouse connection closed before each call: DuckDB lets no writer
    open the file while any reader holds it, and an LLM call can take minutes. The next query reopens it."""

    def __init__(self, llm: ChatModel, retriever: Retriever):
        self._llm, self._retriever = llm, retriever

    def generate(self, conversations: Sequence[Any], config: Any = None, graph_tokens: Any = None) -> list[Any]:
        self._retriever.graph.close()
        if graph_tokens is None:
            return self._llm.generate(conversations, config)
        return self._llm.generate(conversations, config, graph_tokens)

    def complete(self, conversation: Any, config: Any = None) -> Any:
        return self.generate([conversation], config)[0]

    def __getattr__(self, name: str) -> Any:  # name, supports_graph_tokens, hidden_size, ...
        return getattr(self._llm, name)


def _ask_method_family(name: str) -> str | None:
    """The built-in method a method or ablation name runs ("sema-rag-no-e-agent" -> "sema-rag"), without
    importing the methods (the clock has not started yet); None for an unknown name."""
    return max((m for m in ASK_USUAL_S if name == m or name.startswith(f"{m}-")), key=len, default=None)


def ask_default_timeout(method: str) -> float:
    """`medgraph ask`'s time limit when --timeout is not given: the method's usual time with headroom."""
    family = _ask_method_family(method)
    return max(ASK_TIMEOUT_S, round(ASK_TIMEOUT_HEADROOM * ASK_USUAL_S[family])) if family else ASK_TIMEOUT_S


def _usual_time(method: str) -> str:
    family = _ask_method_family(method)
    if family is None:
        return ""
    return (f"; {family} usually takes about {ASK_USUAL_S[family]:.0f} s with SmolLM2-135M on 2 CPU cores "
            f"(model loading included)")


def _cmd_ask(args: argparse.Namespace) -> int:
    """Answer one question with one method over the warehouse's KG and corpus; optionally show the trace.

    Everything the command line can get wrong is checked before any model is loaded (exit status 2); the
    time limit covers the whole call from here on."""
    if args.timeout is None:
        args.timeout = ask_default_timeout(args.method)
    if args.timeout < 0:
        raise UsageError(f"--timeout must be >= 0 seconds (0: no limit), got {args.timeout:g}")
    question = _read_question(args)  # before the clock starts: standard input may be a person typing
    options = _parse_options(args.option)
    _check_question_length(question, options, args.max_question_chars)
    stage = ["starting"]
    deadline = time.monotonic() + args.timeout if args.timeout else None
    try:
        with _time_limit(args.timeout):
            return _checked_answer(args, question, options, deadline, stage)
    except AskTimedOut:
        pass
    except Exception as error:
        from medgraph.llm.openai_http import LlmRequestError

        if not isinstance(error, LlmRequestError):
            raise
        if deadline is None or time.monotonic() < deadline - 0.5:
            print(f"medgraph ask: {error}", file=sys.stderr)
            return 1
    print(f"medgraph ask: no answer within the time limit of {args.timeout:g} s (--timeout) while {stage[0]}"
          f"{_usual_time(args.method)}; raise it with --timeout SECONDS (0: no limit)", file=sys.stderr)
    return EXIT_TIMEOUT


def _checked_answer(args: argparse.Namespace, question: str, options: dict[str, str], deadline: float | None,
                    stage: list[str]) -> int:
    from medgraph.methods import make_config
    from medgraph.methods.registry import ABLATIONS, METHODS
    from medgraph.qa.item import QaItem

    method = ABLATIONS.get(args.method, (args.method, {}))[0]
    if method not in METHODS:
        raise UsageError(f"unknown method {args.method!r}; methods: {', '.join(METHODS)}; "
                         f"ablations: {', '.join(ABLATIONS)}")
    try:
        config = make_config(args.method, _parse_overrides(args.set, METHODS[method].config_type))
    except (ValueError, TypeError) as error:  # a field's own validation (e.g. Graph-R1's action names)
        raise UsageError(str(error)) from None
    if args.reader == "adapted":
        from medgraph.eval.readers import base_reader_only

        why = base_reader_only(args.method)
        if why:
            raise UsageError(f"--reader adapted does not apply to {args.method}: {why}")
    item = QaItem(dataset="ask", qid="ask", question=question, options=options, answer="")
    return _answer(args, item, config, deadline, stage)


def _answer(args: argparse.Namespace, item: Any, config: object, deadline: float | None, stage: list[str]) -> int:
    from medgraph.embed.encoder import load_encoder
    from medgraph.llm import load_llm
    from medgraph.llm.openai_http import OpenAIChatModel
    from medgraph.methods import method_of, run_method
    from medgraph.retrieval import Retriever
    from medgraph.settings import load_settings, redact_uri
    from medgraph.storage import open_warehouse

    settings = load_settings()
    warehouse = open_warehouse(settings)
    if not warehouse.path.exists():
        print(f"no warehouse at {warehouse.path}: build the platform first (`make demo`)", file=sys.stderr)
        return 1
    # `stage` says what runs now: the time limit's message names it.
    registry = redact_uri(settings.mlflow_tracking_uri)
    llm = None
    if method_of(args.method) == "graph-r1" and args.llm is None:
        # As evaluation picks it (GRPO, else SFT, else the base LLM), in the environment it was trained in;
        # --set values still win.
        stage[0] = f"reading the model registry ({registry}) for the Graph-R1 policy"
        llm, environment = _champion_policy(settings, args.method, stage)
        given = {pair.split("=", 1)[0].strip() for pair in args.set}
        config = dataclasses.replace(config, **{k: v for k, v in environment.items() if k not in given})
    if llm is None:
        stage[0] = f"loading the LLM ({redact_uri(args.llm or settings.llm)})"
        llm = load_llm(args.llm or settings.llm, home=settings.home)
    reader = _adapted_reader(settings, stage) if args.reader == "adapted" else None
    if isinstance(llm, OpenAIChatModel) and deadline is not None:
        # Each request waits at most until the call's deadline (not 5 x 120 s of read timeouts and retries).
        llm.deadline = deadline
        llm.timeout_s = min(llm.timeout_s, args.timeout)
    try:
        graph_tokenizer, no_tokenizer = None, ""
        if method_of(args.method) == "a2rag":
            stage[0] = f"reading the model registry ({registry}) and loading the HIIM projector"
            graph_tokenizer, no_tokenizer = _champion_graph_tokenizer(llm, warehouse, settings)
        encoder = _LazyEncoder(lambda: load_encoder(settings.encoder), f"loading the encoder ({settings.encoder})",
                               stage)
        stage[0] = f"answering with {args.method} (LLM {redact_uri(args.llm or settings.llm)})"
        with Retriever(warehouse, encoder) as retriever:
            model = _ClosesWarehouseWhileGenerating(llm, retriever)
            (result,) = run_method(args.method, [item], retriever, model, config, graph_tokenizer=graph_tokenizer,
                                   reader=reader)
    finally:
        llm.close()
        if reader is not None:
            reader.close()
    if no_tokenizer and result.stats.get("hiim") == "text-only":
        result.stats["hiim_reason"] = no_tokenizer  # A2RAG says only that it had none; this says why
    return _print_answer(args, item, result)


def _print_answer(args: argparse.Namespace, item: Any, result: Any) -> int:
    """The answer as JSON, or as one line (after the trace with --trace); exit status 2 when unparseable."""
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
    print(printable(f"answer: {result.prediction}" + (f". {text}" if text else "")))
    return 0


def _adapted_reader(settings: Settings, stage: list[str]) -> ChatModel:
    """The champion reader adapter (`--reader adapted`); none registered is an error that says what to build."""
    from medgraph.eval.readers import load_adapted_reader
    from medgraph.settings import redact_uri
    from medgraph.tracking import Tracking, limit_registry_waits

    limit_registry_waits()
    stage[0] = f"reading the model registry ({redact_uri(settings.mlflow_tracking_uri)}) for the reader adapter"
    reader, source = load_adapted_reader(Tracking.from_settings(settings))
    if reader is None:
        print(f"medgraph ask: --reader adapted: {source}", file=sys.stderr)
        raise SystemExit(2)
    print(f"reader: {source}", file=sys.stderr)
    return reader


def _champion_policy(settings: Settings, method: str,
                     stage: list[str] | None = None) -> tuple[ChatModel | None, dict[str, object]]:
    """The policy evaluation would run `method` with (the GRPO champion, else the SFT champion), or None for the
    base LLM, and the Graph-R1 environment it was trained in; says which policy on stderr (and in `stage`)."""
    try:
        from medgraph.rl.policy import choose_policy, load_chosen_policy, policy_environment
        from medgraph.tracking import Tracking, limit_registry_waits
    except ImportError:
        return None, {}
    limit_registry_waits()
    tracking = Tracking.from_settings(settings)
    choice = choose_policy(method, tracking)
    if choice.source is None:  # e.g. graph-r1-sft-only without a registered SFT policy: never run the base LLM instead
        print(f"medgraph ask: {method} {choice.description}", file=sys.stderr)
        raise SystemExit(2)
    print(f"policy: {choice.description}", file=sys.stderr)
    if stage is not None and choice.model_uri is not None:
        stage[0] = f"loading the Graph-R1 policy {choice.description}"
    return load_chosen_policy(choice, tracking), policy_environment(choice.model_uri, tracking)


def _cmd_models(args: argparse.Namespace) -> int:
    """Registered models: `list` (every model, its champion and latest version) or `show NAME[@ALIAS|/VERSION]`."""
    from mlflow.exceptions import MlflowException

    from medgraph.settings import load_settings, redact_uri
    from medgraph.tracking import Tracking, limit_registry_waits

    limit_registry_waits()
    settings = load_settings()
    tracking = Tracking.from_settings(settings)
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
        print(printable(f"  tag        {key} = {found.tags[key]}"))
    lineage = {k: v for k, v in run.data.tags.items() if k.startswith(("data_version/", "dagster/", "lineage/"))}
    for key in sorted(lineage):
        print(printable(f"  lineage    {key} = {lineage[key]}"))
    for key in sorted(run.data.metrics):
        print(f"  metric     {key} = {run.data.metrics[key]:.4g}")
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="medgraph", description="MedGraph: UMLS knowledge graph and GraphRAG.")
    parser.add_argument("--traceback", action="store_true",
                        help="on an error, also print where it was raised (credentials redacted)")
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
    ask.add_argument("question", nargs="?", default=None,
                     help="the question text; - reads it from standard input")
    ask.add_argument("--question-file", default=None, metavar="PATH",
                     help="read the question from a UTF-8 text file (- for standard input)")
    ask.add_argument("--max-question-chars", type=int, default=MAX_QUESTION_CHARS, metavar="N",
                     help=f"refuse longer questions, options included (default {MAX_QUESTION_CHARS:,}; 0: no limit)")
    ask.add_argument("--timeout", type=float, default=None, metavar="SECONDS",
                     help=f"time limit for the whole call, model loading included; HTTP LLM requests wait at "
                          f"most this long (default: per method, {ASK_TIMEOUT_HEADROOM:g}x its usual time on 2 CPU "
                          f"cores, at least {ASK_TIMEOUT_S:g}; 0: no limit; exit status {EXIT_TIMEOUT})")
    ask.add_argument("--option", action="append", default=[], metavar='LETTER="TEXT"',
                     help='a multiple-choice option, e.g. --option A="amlodipine" (repeat; none: short answer)')
    usual = ", ".join(f"{method} ~{seconds:.0f} s" for method, seconds in ASK_USUAL_S.items())
    ask.add_argument("--method", default="a2rag",
                     help="a2rag, graph-r1, sema-rag, cot, rag, rag-kg, irag, or a named ablation such as a2rag-no-gsrm "
                          f"(medgraph.methods.ABLATIONS); default: a2rag. Usual time of a question with SmolLM2-135M "
                          f"on 2 CPU cores, model loading included: {usual}")
    ask.add_argument("--llm", default=None, help=f"LLM spec (default: MEDGRAPH_LLM, {DEFAULT_LLM})")
    ask.add_argument("--reader", choices=("base", "adapted"), default="base",
                     help="who answers the answering call: the LLM (base) or the registered reader adapter "
                          "(adapted: medgraph-reader-adapter@champion, models/reader_adapter); the other calls stay "
                          "with the LLM")
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
    """Entry point of the `medgraph` console script; returns the exit status.

    No message, log line or error it prints shows a credential (`redact_uri`), and an error is one line that
    says what went wrong, not a traceback (`--traceback` adds it, redacted)."""
    from medgraph.settings import install_log_redaction, redact_uri

    args = _parser().parse_args(argv)
    install_log_redaction()
    with _exit_on_termination():
        try:
            return int(args.handler(args))
        except UsageError as error:
            print(f"medgraph {args.command}: error: {printable(redact_uri(str(error)))}", file=sys.stderr)
            return 2
        except Exception as error:  # noqa: BLE001 - every error ends as one redacted line, not a traceback
            registry = _registry_problem(error)
            ours = registry is not None or type(error).__module__.startswith("medgraph.")  # written to be read as is
            what = registry or (redact_uri(str(error)) if ours else f"{type(error).__name__}: {redact_uri(str(error))}")
            print(f"medgraph {args.command}: error: {printable(what)}", file=sys.stderr)
            if args.traceback:
                import traceback

                print(redact_uri("".join(traceback.format_exception(error))), file=sys.stderr, end="")
            elif not ours:
                print(f"medgraph {args.command}: (unexpected: `medgraph --traceback {args.command} ...` shows where "
                      "it was raised)", file=sys.stderr)
            return 1


@contextmanager
def _exit_on_termination() -> Iterator[None]:
    """SIGTERM/SIGINT end the command promptly: the signal unwinds the main thread (SystemExit, so
    `finally` blocks close connections and discard staging files), and a watchdog ends the process
    EXIT_GRACE_S later if that has not (a worker thread stuck in a request, the main thread inside a
    long native call). The watchdog hears the signal through signal.set_wakeup_fd, which the C-level
    handler writes at once, even while the main thread cannot run Python code. A second signal
    exits at once."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    import socket

    watched = (signal.SIGTERM, signal.SIGINT)
    received: list[int] = []
    reader, writer = socket.socketpair()
    writer.setblocking(False)

    def on_signal(signum: int, frame: object) -> None:
        if received:
            os._exit(128 + signum)
        received.append(signum)
        raise SystemExit(128 + signum)

    def watchdog() -> None:
        while True:
            try:
                data = reader.recv(64)
            except OSError:
                return
            if not data:
                return
            hit = [n for n in data if n in watched]
            if hit:
                time.sleep(EXIT_GRACE_S)
                os._exit(128 + hit[0])

    previous = {signum: signal.signal(signum, on_signal) for signum in watched}
    previous_fd = signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False)
    thread = threading.Thread(target=watchdog, name="medgraph-exit-watchdog", daemon=True)
    thread.start()
    try:
        yield
    finally:
        signal.set_wakeup_fd(previous_fd)
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        if not received:  # after a signal the watchdog stays armed until the process has exited
            writer.close()
            reader.close()


if __name__ == "__main__":
    raise SystemExit(main())
