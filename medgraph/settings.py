"""Platform settings, read from the environment in one place (see docs/ARCHITECTURE.md "Settings")."""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, TypeVar

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


@dataclass(frozen=True)
class Settings:
    home: Path
    umls_dir: str | None
    profile: str
    encoder: str
    llm: str
    mlflow_tracking_uri: str
    benchmark: str = "kg"  # evaluation benchmark spec (medgraph.eval.benchmarks)
    lake: str = ""  # MEDGRAPH_LAKE: a local directory or s3://bucket/prefix; "" = $MEDGRAPH_HOME/lake
    s3_endpoint_url: str | None = None  # an S3-compatible server (MinIO, moto); None = AWS (or AWS_ENDPOINT_URL_S3)
    aws_secret_id: str | None = None  # a Secrets Manager secret holding the AWS keys; None = the AWS chain
    mlflow_artifacts: str = ""  # MEDGRAPH_MLFLOW_ARTIFACTS: where new experiments keep artifacts (s3://...); "" = $MEDGRAPH_HOME/artifacts

    @property
    def lake_location(self) -> str:
        return self.lake or str(self.lake_root)

    @property
    def warehouse_path(self) -> Path:
        return self.home / "warehouse.duckdb"

    @property
    def lake_root(self) -> Path:
        return self.home / "lake"

    @property
    def sample_release_dir(self) -> Path:
        return self.home / "sample_release" / self.profile


def load_settings(env: dict[str, str] | None = None) -> Settings:
    """Settings from `env` (default: the process environment), with docs/ARCHITECTURE.md defaults."""
    env = os.environ if env is None else env
    home = Path(env.get("MEDGRAPH_HOME") or "./.medgraph").expanduser().resolve()
    profile = env.get("MEDGRAPH_PROFILE") or "demo"
    if profile not in PROFILES:
        raise ValueError(f"MEDGRAPH_PROFILE must be one of {', '.join(PROFILES)}, got {profile!r}")
    return Settings(
        home=home,
        umls_dir=env.get("MEDGRAPH_UMLS_DIR") or None,
        profile=profile,
        encoder=env.get("MEDGRAPH_ENCODER") or "minilm",
        llm=env.get("MEDGRAPH_LLM") or "smollm2-135m-instruct",
        mlflow_tracking_uri=env.get("MLFLOW_TRACKING_URI") or f"sqlite:///{home / 'mlflow.db'}",
        benchmark=env.get("MEDGRAPH_BENCHMARK") or "kg",
        lake=env.get("MEDGRAPH_LAKE") or "",
        s3_endpoint_url=env.get("MEDGRAPH_S3_ENDPOINT_URL") or None,
        aws_secret_id=env.get("MEDGRAPH_AWS_SECRET_ID") or None,
        mlflow_artifacts=env.get("MEDGRAPH_MLFLOW_ARTIFACTS") or "",
    )
