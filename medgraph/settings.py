"""Platform settings, read from the environment in one place (see docs/ARCHITECTURE.md "Settings")."""

from __future__ import annotations

import logging
import os
import re
import sys
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, TypeVar

from medgraph.home import HomeLayout

DEFAULT_LLM = "smollm2-135m-instruct"  # the built-in default of MEDGRAPH_LLM (medgraph.llm.models)

PROFILES = ("tiny", "demo", "full")


Config = TypeVar("Config")


def profile_config(profiles: Mapping[str, Config], what: str, name: str, **overrides: Any) -> Config:
    """The dataclass config of profile `name` in `profiles` with `overrides` applied; an unknown name is an
    error that lists the known ones (each trainer's `Config.profile` is this over its own table)."""
    if name not in profiles:
        raise ValueError(f"unknown {what} profile {name!r}: one of {', '.join(profiles)}")
    return replace(profiles[name], **overrides)

# `scheme://user:password@host`: everything between `//` and the `@` before the host is a credential.
_USERINFO = re.compile(r"(?P<scheme>\b[A-Za-z][A-Za-z0-9+.-]*://)(?P<user>[^\s/@:?#]*)(?P<secret>:[^\s/?#]*)?@")
# Query parameters that carry secrets (presigned S3 URLs, token-in-URL servers, database URLs).
_SECRET_PARAMETER = re.compile(
    r"(?i)(?P<name>[?&;](?:password|passwd|pwd|secret|token|access_token|api[_-]?key|key|sig|signature"
    r"|x-amz-signature|x-amz-credential|x-amz-security-token)=)[^&;#\s]*")
REDACTED = "***"


def redact_uri(text: str | None) -> str | None:
    """`text` (a URI, or any message holding URIs) with credentials replaced by `***`, for printing,
    logging and tagging: `http://admin:pw@host` -> `http://admin:***@host`, `https://TOKEN@host` ->
    `https://***@host`, `?password=x` -> `?password=***`. Text without credentials comes back unchanged."""
    if not text:
        return text

    def userinfo(match: re.Match) -> str:
        if match["secret"] is not None:
            return f"{match['scheme']}{match['user']}:{REDACTED}@"
        return f"{match['scheme']}{REDACTED}@"  # a lone user part is often a token

    return _SECRET_PARAMETER.sub(lambda m: m["name"] + REDACTED, _USERINFO.sub(userinfo, text))


class RedactedError(RuntimeError):
    """An error whose message (or a cause's) held a credential, raised again with `redact_uri` applied to
    the whole chain's messages; the original exceptions, which still hold it, are dropped."""

    def __init__(self, message: str, original_type: str):
        super().__init__(message)
        self.original_type = original_type


def _chain(error: BaseException) -> list[BaseException]:
    """`error` and the exceptions it was raised from or during, innermost last (no cycles)."""
    chain: list[BaseException] = []
    while error is not None and not any(error is seen for seen in chain):
        chain.append(error)
        error = error.__cause__ or (None if error.__suppress_context__ else error.__context__)
    return chain


def redacted_error(error: BaseException) -> BaseException | None:
    """An exception to raise instead of `error` when the messages of `error` or its causes hold a credential
    (`redact_uri` would change them), else None (raise `error` itself).

    The replacement keeps what can be kept: an MLflow error stays an `MlflowException` with its error code
    (callers tell "not found" from "unreachable" by it), anything else becomes a `RedactedError` whose
    message names the original type. Causes are folded into the message: a chained exception would print
    the credential again."""
    chain = _chain(error)
    if all(redact_uri(str(e)) == str(e) for e in chain):
        return None
    message = redact_uri(str(error))
    for cause in chain[1:]:
        text = redact_uri(str(cause))
        if text and text not in message:
            message += f" (caused by {type(cause).__name__}: {text})"
    mlflow_errors = sys.modules.get("mlflow.exceptions")  # loaded if `error` is one; settings never imports mlflow
    if mlflow_errors is not None and isinstance(error, mlflow_errors.MlflowException):
        return mlflow_errors.MlflowException(message, error_code=error.error_code)
    return RedactedError(f"{type(error).__name__}: {message}", type(error).__name__)


@contextmanager
def redacting_errors() -> Iterator[None]:
    """Raise any exception of the block again without the credentials its messages hold (`redacted_error`)."""
    try:
        yield
    except Exception as error:
        replacement = redacted_error(error)
        if replacement is None:
            raise
        raise replacement from None


def redact_record(record: logging.LogRecord) -> logging.LogRecord:
    """`record` with `redact_uri` applied to its message and exception text (in place)."""
    try:
        message = record.getMessage()
    except Exception:  # noqa: BLE001 - a malformed record is logging's to report, not ours
        return record
    shown = redact_uri(message)
    if shown != message:
        record.msg, record.args = shown, None
    if record.exc_info and record.exc_info[1] is not None:
        text = logging.Formatter().formatException(record.exc_info)
        if redact_uri(text) != text:
            record.exc_text, record.exc_info = redact_uri(text), None
    return record


def install_log_redaction() -> None:
    """Make every log record this process creates, from any logger (MLflow's, boto's, Dagster's, ours),
    carry its message and exception text through `redact_uri`: a URI with credentials never reaches a handler.
    Idempotent."""
    factory = logging.getLogRecordFactory()
    if getattr(factory, "redacting", False):
        return

    def redacting_factory(*args: Any, **kwargs: Any) -> logging.LogRecord:
        return redact_record(factory(*args, **kwargs))

    redacting_factory.redacting = True  # type: ignore[attr-defined]
    logging.setLogRecordFactory(redacting_factory)


@dataclass(frozen=True)
class Settings:
    home: Path
    umls_dir: str | None
    profile: str
    encoder: str
    llm: str
    mlflow_tracking_uri: str
    benchmark: str = "kg"  # evaluation benchmark spec (medgraph.qa.benchmarks)
    lake: str = ""  # MEDGRAPH_LAKE: a local directory or s3://bucket/prefix; "" = $MEDGRAPH_HOME/lake
    s3_endpoint_url: str | None = None  # an S3-compatible server (MinIO, moto); None = AWS (or AWS_ENDPOINT_URL_S3)
    aws_secret_id: str | None = None  # a Secrets Manager secret holding the AWS keys; None = the AWS chain
    mlflow_artifacts: str = ""  # MEDGRAPH_MLFLOW_ARTIFACTS: where new experiments keep artifacts (s3://...); "" = $MEDGRAPH_HOME/artifacts
    embedding_shards: int = 1  # MEDGRAPH_EMBEDDING_SHARDS: node/edge embeddings in this many partitions, then merged
    # MEDGRAPH_DUCKDB_MEMORY_LIMIT: DuckDB's memory_limit for the assets' warehouse and the dbt models (past it,
    # joins and sorts spill to disk). None: 2GB for the assets, DuckDB's own default (80% of RAM) for dbt,
    # because kg_edges does not spill: at 10M MRREL rows it fails in 2 GB ("Out of Memory Error") and peaks at 4 GB.
    duckdb_memory_limit: str | None = None

    @property
    def lake_location(self) -> str:
        return self.lake or str(self.lake_root)

    @property
    def layout(self) -> HomeLayout:
        return HomeLayout(self.home)

    @property
    def warehouse_path(self) -> Path:
        return self.layout.warehouse

    @property
    def lake_root(self) -> Path:
        return self.layout.lake

    @property
    def sample_release_dir(self) -> Path:
        return self.layout.sample_release(self.profile)


def load_settings(env: dict[str, str] | None = None) -> Settings:
    """Settings from `env` (default: the process environment), with docs/ARCHITECTURE.md defaults."""
    env = os.environ if env is None else env
    home = Path(env.get("MEDGRAPH_HOME") or "./.medgraph").expanduser().resolve()
    profile = env.get("MEDGRAPH_PROFILE") or "demo"
    if profile not in PROFILES:
        raise ValueError(f"MEDGRAPH_PROFILE must be one of {', '.join(PROFILES)}, got {profile!r}")
    shards = env.get("MEDGRAPH_EMBEDDING_SHARDS") or "1"
    if not shards.isdigit() or int(shards) < 1:
        raise ValueError(f"MEDGRAPH_EMBEDDING_SHARDS must be a whole number >= 1, got {shards!r}")
    return Settings(
        home=home,
        umls_dir=env.get("MEDGRAPH_UMLS_DIR") or None,
        profile=profile,
        encoder=env.get("MEDGRAPH_ENCODER") or "minilm",
        llm=env.get("MEDGRAPH_LLM") or DEFAULT_LLM,
        mlflow_tracking_uri=env.get("MLFLOW_TRACKING_URI") or f"sqlite:///{HomeLayout(home).mlflow_db}",
        benchmark=env.get("MEDGRAPH_BENCHMARK") or "kg",
        lake=env.get("MEDGRAPH_LAKE") or "",
        s3_endpoint_url=env.get("MEDGRAPH_S3_ENDPOINT_URL") or None,
        aws_secret_id=env.get("MEDGRAPH_AWS_SECRET_ID") or None,
        mlflow_artifacts=env.get("MEDGRAPH_MLFLOW_ARTIFACTS") or "",
        embedding_shards=int(shards),
        duckdb_memory_limit=_memory_size(env["MEDGRAPH_DUCKDB_MEMORY_LIMIT"]) if env.get("MEDGRAPH_DUCKDB_MEMORY_LIMIT")
        else None,
    )


def _memory_size(value: str) -> str:
    """A DuckDB memory size ("2GB", "512MiB"), checked here so that a typo fails at start, not mid-run."""
    if not re.fullmatch(r"\s*\d+(\.\d+)?\s*(B|KB|MB|GB|TB|KiB|MiB|GiB|TiB)\s*", value, re.IGNORECASE):
        raise ValueError(f"MEDGRAPH_DUCKDB_MEMORY_LIMIT must be a size such as 2GB or 512MiB, got {value!r}")
    return value.strip()
