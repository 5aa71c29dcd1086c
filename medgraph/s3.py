"""S3 for the lake and the UMLS release: URIs, DuckDB's httpfs, atomic publishing, a local release cache.

DuckDB reads and writes the lake's Parquet files on S3 itself (httpfs, loaded
from the `duckdb-extension-httpfs` package file: `INSTALL httpfs` by name would
go to the internet). boto3 does what DuckDB cannot: the server-side copy that
publishes a table, deletes, sizes, listings and release downloads. One function,
`s3_client_and_options`, builds the boto3 client and DuckDB's options; the
Dagster resources call it with their config, so this module knows nothing
about Dagster.
"""

from __future__ import annotations

import fnmatch
import glob
import hashlib
import importlib.util
import json
import logging
import os
import re
import shutil
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import duckdb

from medgraph.files import staging_path
from medgraph.settings import redact_uri

log = logging.getLogger(__name__)

_S3_URI = re.compile(r"^s3://(?P<bucket>[a-z0-9][a-z0-9.\-]{1,61}[a-z0-9])(?:/(?P<prefix>.*))?$")


class S3UriError(ValueError):
    """A string that should be `s3://bucket[/prefix]` is not."""


class LakeNotLocalError(NotImplementedError):
    """Code that treats the lake as a local directory (`lake.root`) ran with the lake on S3."""


def is_s3_uri(location: str | os.PathLike | None) -> bool:
    return isinstance(location, str) and location.startswith("s3://")


def parse_s3_uri(uri: str) -> tuple[str, str]:
    """`s3://bucket/a/b/` -> ("bucket", "a/b") with no trailing slash; a clear error otherwise."""
    match = _S3_URI.match(uri)
    if not match:
        raise S3UriError(f"not an S3 location: {uri!r} (expected s3://bucket[/prefix], bucket names in lower case)")
    return match["bucket"], (match["prefix"] or "").strip("/")


@dataclass(frozen=True)
class S3Options:
    """How DuckDB reaches S3. Credentials are kept out of repr (and so out of logs and metadata)."""

    region: str
    endpoint_url: str | None = None  # None: AWS itself; else an S3-compatible server (MinIO, moto, ...)
    key_id: str | None = field(default=None, repr=False)
    secret: str | None = field(default=None, repr=False)
    session_token: str | None = field(default=None, repr=False)

    def secret_sql(self, name: str, scope: str) -> str:
        """`CREATE OR REPLACE SECRET` for DuckDB (temporary: in memory only, never on disk)."""
        params = {"TYPE": "s3", "REGION": self.region, "SCOPE": scope}
        if self.key_id:
            params.update(KEY_ID=self.key_id, SECRET=self.secret or "")
        if self.session_token:
            params["SESSION_TOKEN"] = self.session_token
        if self.endpoint_url:
            # A custom endpoint (MinIO, moto) serves buckets as paths, not as host names.
            endpoint = urlparse(self.endpoint_url)
            params.update(ENDPOINT=endpoint.netloc, URL_STYLE="path", USE_SSL=str(endpoint.scheme == "https").lower())
        body = ", ".join(f"{k} {v}" if k == "TYPE" else f"{k} {_quote(v)}" for k, v in params.items())
        return f"CREATE OR REPLACE SECRET {name} ({body})"


_AWS_HOST_SUFFIXES = (".amazonaws.com", ".amazonaws.com.cn")


def options_for(client: Any, session: Any) -> S3Options:
    """DuckDB's view of a boto3 S3 client: its endpoint (unless AWS's own), region and the session's
    resolved credentials, so DuckDB and boto3 act with the same identity."""
    credentials = session.get_credentials()
    frozen = credentials.get_frozen_credentials() if credentials else None
    endpoint = client.meta.endpoint_url
    custom = endpoint if not endpoint.split("://", 1)[-1].split("/", 1)[0].endswith(_AWS_HOST_SUFFIXES) else None
    return S3Options(region=client.meta.region_name or "us-east-1", endpoint_url=custom,
                     key_id=frozen.access_key if frozen else None, secret=frozen.secret_key if frozen else None,
                     session_token=frozen.token if frozen else None)


class SecretValueError(ValueError):
    """A Secrets Manager secret is missing or does not have the expected shape (the message never holds values)."""


def read_json_secret(secrets_client: Any, secret_id: str, required: tuple[str, ...] = ()) -> dict[str, str]:
    """The JSON object stored in the Secrets Manager secret `secret_id`, with every `required` key present."""
    import botocore.exceptions

    try:
        raw = secrets_client.get_secret_value(SecretId=secret_id)["SecretString"]
    except (botocore.exceptions.BotoCoreError, botocore.exceptions.ClientError) as error:
        # Say which secret failed, never what is in it.
        raise SecretValueError(f"cannot read secret {secret_id!r} from Secrets Manager: "
                               f"{type(error).__name__}") from None
    try:
        values = json.loads(raw)
    except ValueError:
        raise SecretValueError(f"secret {secret_id!r} is not a JSON object") from None
    if not isinstance(values, dict):
        raise SecretValueError(f"secret {secret_id!r} is not a JSON object")
    missing = [k for k in required if not values.get(k)]
    if missing:
        raise SecretValueError(f"secret {secret_id!r} lacks the keys {missing}")
    return {k: str(v) for k, v in values.items()}


_AWS_KEY_NAMES = ("aws_access_key_id", "aws_secret_access_key", "aws_session_token")


def s3_client_and_options(endpoint_url: str | None = None, credentials_secret_id: str | None = None, *,
                          region_name: str | None = None, profile_name: str | None = None,
                          aws_access_key_id: str | None = None, aws_secret_access_key: str | None = None,
                          aws_session_token: str | None = None, max_attempts: int = 5, use_ssl: bool = True,
                          verify: bool | None = None, secrets_endpoint_url: str | None = None,
                          ) -> tuple[Any, S3Options]:
    """A boto3 S3 client and DuckDB's options for the same endpoint, region and credentials: the one builder
    behind the CLI, the launchers and the Dagster resources (resources/warehouse.py `S3Access`).

    Keys come from the AWS chain (env, profile, role), or from the Secrets Manager secret
    `credentials_secret_id` (JSON with aws_access_key_id, aws_secret_access_key, optionally
    aws_session_token; Secrets Manager at `secrets_endpoint_url`, else boto3's own
    AWS_ENDPOINT_URL_SECRETS_MANAGER or AWS). One session serves the client and DuckDB, so both act with the
    same identity."""
    import boto3
    import botocore.config

    config = botocore.config.Config(retries={"max_attempts": max_attempts, "mode": "standard"})
    keys = dict(zip(_AWS_KEY_NAMES, (aws_access_key_id, aws_secret_access_key, aws_session_token), strict=True))
    if credentials_secret_id:
        secrets = boto3.session.Session(profile_name=profile_name, region_name=region_name).client(
            "secretsmanager", endpoint_url=secrets_endpoint_url, config=config)
        values = read_json_secret(secrets, credentials_secret_id, _AWS_KEY_NAMES[:2])
        keys = {k: values.get(k) for k in _AWS_KEY_NAMES}
    session = boto3.session.Session(profile_name=profile_name, region_name=region_name, **keys)
    client = session.client("s3", endpoint_url=_without_userinfo(endpoint_url), use_ssl=use_ssl, verify=verify,
                            config=config)
    return client, options_for(client, session)


def _without_userinfo(endpoint_url: str | None) -> str | None:
    """`endpoint_url` without a `user:password@` part, which S3 does not use (requests are signed with the
    keys) and which botocore's and DuckDB's errors would print; a warning (redacted) says it was dropped."""
    if not endpoint_url:
        return endpoint_url
    parts = urlparse(endpoint_url)
    if "@" not in parts.netloc:
        return endpoint_url
    log.warning("S3 endpoint %s: dropped the credentials in its URL, which S3 does not use; give the keys "
                "through MEDGRAPH_AWS_SECRET_ID or the AWS chain (AWS_ACCESS_KEY_ID, ...)", redact_uri(endpoint_url))
    return parts._replace(netloc=parts.netloc.rsplit("@", 1)[1]).geturl()


def _quote(value: str) -> str:
    return "'" + str(value).replace("'", "''") + "'"


def httpfs_extension_path() -> Path:
    """The httpfs extension file shipped in the `duckdb-extension-httpfs` package for this DuckDB version."""
    spec = importlib.util.find_spec("duckdb_extension_httpfs")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("an S3 lake needs the package 'duckdb-extension-httpfs' (same version as duckdb)")
    path = Path(next(iter(spec.submodule_search_locations))) / "extensions" / f"v{duckdb.__version__}" / \
        "httpfs.duckdb_extension"
    if not path.is_file():
        raise FileNotFoundError(f"no httpfs extension for duckdb {duckdb.__version__} at {path}; "
                                f"install duckdb-extension-httpfs=={duckdb.__version__}")
    return path


def install_httpfs(extension_dir: Path) -> None:
    """Put httpfs into a private extension directory, so connections (and dbt's, in its own process)
    autoload it from there instead of from the internet or ~/.duckdb."""
    if list(extension_dir.glob(f"v{duckdb.__version__}/*/httpfs.duckdb_extension")):
        return
    extension_dir.mkdir(parents=True, exist_ok=True)
    with duckdb.connect(config={"extension_directory": str(extension_dir)}) as con:
        con.execute(f"INSTALL {_quote(str(httpfs_extension_path()))}")


@dataclass(frozen=True)
class S3Lake:
    """Parquet files under an S3 prefix: `s3://bucket/prefix/<schema>/<table>.parquet`.

    Publishing is write-then-copy. DuckDB writes the new file completely to a
    staging key (an S3 object becomes visible only when its upload completes;
    a failed upload leaves nothing), the caller validates it, then a server-side
    CopyObject makes it the table's key in one step and the staging object is
    deleted. Readers of the table key see the old object or the new one, never
    a partial one, and a write that fails before the copy leaves the old table.
    Staging keys live under `<prefix>/.staging/` so no table glob matches them.
    """

    uri: str
    client: Any = field(repr=False, compare=False)  # a boto3 S3 client
    options: S3Options = field(repr=False)
    local_dir: Path  # DuckDB spill files and the extension directory (local disk, never on S3)

    def __post_init__(self) -> None:
        parse_s3_uri(self.uri)  # fail early on a malformed location

    is_local = False

    @property
    def bucket(self) -> str:
        return parse_s3_uri(self.uri)[0]

    @property
    def prefix(self) -> str:
        return parse_s3_uri(self.uri)[1]

    def _uri(self, *parts: str) -> str:
        key = "/".join(p for p in (self.prefix, *parts) if p)
        return f"s3://{self.bucket}/{key}"

    def _key(self, uri: str) -> str:
        bucket, key = parse_s3_uri(uri)
        if bucket != self.bucket:
            raise S3UriError(f"{uri} is not in the lake's bucket {self.bucket}")
        return key

    def table_path(self, schema: str, table: str) -> str:
        return self.file_path(schema, f"{table}.parquet")

    def file_path(self, schema: str, name: str) -> str:
        return self._uri(schema, name)

    def staging_path(self, schema: str, table: str) -> str:
        return self._uri(".staging", schema, f"{table}.{uuid.uuid4().hex[:12]}.parquet")

    def scratch_path(self, schema: str, name: str, suffix: str = ".parquet") -> Path:
        """A fresh local file (pyarrow, FAISS and numpy write local files; intermediate results never
        need to cross the network). `install` uploads it."""
        path = self.local_dir / "scratch" / schema / f".{name}.{uuid.uuid4().hex[:12]}.tmp{suffix}"
        path.parent.mkdir(parents=True, exist_ok=True)
        return path

    def publish(self, staging: str, schema: str, table: str, version: str | None = None) -> str:
        """The staging object becomes the table's key (or, with a `version`, the new key
        `<table>.<version>.parquet`, as `Lake.publish`)."""
        return self._promote(staging, self.version_path(schema, table, version))

    def version_path(self, schema: str, table: str, version: str | None) -> str:
        return self.file_path(schema, f"{table}.{version}.parquet") if version else self.table_path(schema, table)

    def _promote(self, staging: str, final: str) -> str:
        # client.copy is boto3's managed copy: multipart server-side copy beyond 5 GB, still atomic at the end.
        self.client.copy({"Bucket": self.bucket, "Key": self._key(staging)}, self.bucket, self._key(final))
        self.client.delete_object(Bucket=self.bucket, Key=self._key(staging))
        return final

    def install(self, local: Path, path: str) -> str:
        """Replace the lake file `path` with the local file `local`: upload to a staging key, then the same
        server-side copy as `publish` (readers see the old object or the new one, never a partial one)."""
        relative = self._key(path)[len(self.prefix) + 1 if self.prefix else 0:]
        staging = self._uri(".staging", f"{relative}.{uuid.uuid4().hex[:12]}")
        try:
            self.client.upload_file(str(local), self.bucket, self._key(staging))
            final = self._promote(staging, path)
        except BaseException:
            self.discard(staging)
            raise
        Path(local).unlink(missing_ok=True)
        return final

    def discard(self, staging: str | Path) -> None:
        """Remove a staging object, or a local scratch file (callers discard both kinds the same way)."""
        if isinstance(staging, Path):
            staging.unlink(missing_ok=True)
        else:
            self.client.delete_object(Bucket=self.bucket, Key=self._key(staging))  # no error when absent

    def remove(self, path: str) -> None:
        self.client.delete_object(Bucket=self.bucket, Key=self._key(path))
        for cached in self._cached_versions(self._key(path)):
            cached.unlink(missing_ok=True)

    def glob(self, schema: str, pattern: str) -> list[str]:
        start = self._key(self._uri(schema)) + "/"
        names = [item["Key"][len(start):]
                 for page in self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=start)
                 for item in page.get("Contents", [])]
        return sorted(self.file_path(schema, n) for n in names
                      if "/" not in n and not n.startswith(".") and fnmatch.fnmatchcase(n, pattern))

    def size(self, path: str) -> int:
        return int(self.client.head_object(Bucket=self.bucket, Key=self._key(path))["ContentLength"])

    def exists(self, path: str) -> bool:
        listed = self.client.list_objects_v2(Bucket=self.bucket, Prefix=self._key(path), MaxKeys=1)
        return any(o["Key"] == self._key(path) for o in listed.get("Contents", []))

    # --- local copies: the lake object is the source of truth, local files are caches of it ------------------

    @property
    def cache_dir(self) -> Path:
        return self.local_dir / "cache"

    def _cached_versions(self, key: str) -> list[Path]:
        folder = self.cache_dir / self.bucket / os.path.dirname(key)
        name = os.path.basename(key)
        return list(folder.glob(f"{glob.escape(name)}.*")) if folder.is_dir() else []

    def fetch(self, path: str) -> Path:
        """A local copy of a lake file for readers that need a path (FAISS, numpy), downloaded once per
        content: cached under `local_dir/cache` by key, ETag and size, so loading an unchanged index
        again costs one HEAD request."""
        key = self._key(path)
        head = self.client.head_object(Bucket=self.bucket, Key=key)
        etag, size = head["ETag"].strip('"'), int(head["ContentLength"])
        target = self.cache_dir / self.bucket / f"{key}.{etag}-{size}"
        if target.is_file() and target.stat().st_size == size:
            return target
        target.parent.mkdir(parents=True, exist_ok=True)
        partial = staging_path(target, ".part")
        try:
            self._download(key, etag, size, partial)
            os.replace(partial, target)  # a failed download never leaves a truncated file under its name
        finally:
            partial.unlink(missing_ok=True)
        for stale in self._cached_versions(key):  # earlier contents of the same key
            if stale != target:
                stale.unlink(missing_ok=True)
        return target

    def _download(self, key: str, etag: str, size: int, out: Path) -> None:
        # One GET with If-Match: the bytes are those of the object we looked at, even if the key is
        # republished meanwhile (a managed multi-part download could mix ranges of two versions).
        body = self.client.get_object(Bucket=self.bucket, Key=key, IfMatch=etag)["Body"]
        with out.open("wb") as sink:
            shutil.copyfileobj(body, sink, length=8 << 20)
        if out.stat().st_size != size:
            raise OSError(f"s3://{self.bucket}/{key}: downloaded {out.stat().st_size} bytes, S3 lists {size}")

    @contextmanager
    def local_copy(self, path: str, stable: bool = False) -> Iterator[Path]:
        """A private local copy of a lake file for the block (pyarrow readers of tables), removed afterwards;
        always stable (one If-Match GET). Not cached: tables are large and change with every run."""
        key = self._key(path)
        head = self.client.head_object(Bucket=self.bucket, Key=key)
        copy = self.scratch_path(os.path.dirname(key) or "_", os.path.basename(key), suffix=".copy")
        try:
            self._download(key, head["ETag"].strip('"'), int(head["ContentLength"]), copy)
            yield copy
        finally:
            copy.unlink(missing_ok=True)

    @contextmanager
    def connect(self) -> Iterator[duckdb.DuckDBPyConnection]:
        """An in-memory DuckDB that reads the lake's files through httpfs (no warehouse, no lock)."""
        con = duckdb.connect(config=self.duckdb_config())
        try:
            self.configure(con)
            yield con
        finally:
            con.close()

    @property
    def root(self) -> Path:
        # Everything in medgraph goes through the methods above; code that still treats the lake as a
        # directory must fail with this, not with an AttributeError deep inside.
        raise LakeNotLocalError(
            f"the lake is {self.uri}, not a directory: use the lake's methods (file_path, scratch_path, install, "
            "fetch, local_copy, glob) instead of lake.root")

    @property
    def scratch_dir(self) -> Path:
        return self.local_dir / "duckdb_tmp"

    @property
    def extension_dir(self) -> Path:
        return self.local_dir / "duckdb_extensions"

    def duckdb_config(self) -> dict[str, str]:
        # autoinstall off: a missing extension must be an error, not a download.
        return {"extension_directory": str(self.extension_dir), "autoinstall_known_extensions": "false"}

    def configure(self, con: duckdb.DuckDBPyConnection) -> None:
        """Load httpfs and give this connection the lake's credentials, scoped to the lake's bucket."""
        install_httpfs(self.extension_dir)
        con.execute("LOAD httpfs")
        con.execute(self.options.secret_sql("medgraph_lake", f"s3://{self.bucket}"))


# --- the UMLS release on S3 -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class S3Object:
    key: str
    size: int
    etag: str


def list_objects(client: Any, uri: str) -> list[S3Object]:
    """Every object directly under the prefix (not in sub-"folders"), in key order."""
    bucket, prefix = parse_s3_uri(uri)
    start = f"{prefix}/" if prefix else ""
    found: list[S3Object] = []
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=start):
        for item in page.get("Contents", []):
            name = item["Key"][len(start):]
            if name and "/" not in name:
                found.append(S3Object(item["Key"], int(item["Size"]), item["ETag"].strip('"')))
    return sorted(found, key=lambda o: o.key)


def listing_fingerprint(objects: list[S3Object]) -> str:
    """A content fingerprint from names, sizes and ETags: no download (S3 changes the ETag with the bytes)."""
    digest = hashlib.sha256()
    for obj in objects:
        digest.update(f"{obj.key.rsplit('/', 1)[-1]}\0{obj.size}\0{obj.etag}\0".encode())
    return digest.hexdigest()[:16]


def download_release(client: Any, uri: str, cache_dir: Path, names: tuple[str, ...]) -> Path:
    """Mirror the release files whose names start with one of `names` into `cache_dir`, downloading
    only those whose ETag or size changed since the last call; returns the local directory.

    Why a local copy rather than reading through httpfs: ingestion reads each
    file twice (validate, then write), scans it again for malformed rows, and
    reports errors as `file:line` of a local file; a 9.5 GB MRREL would cross
    the network three times. Each file lands by rename, so a failed download
    never leaves a truncated file under its real name.
    """
    bucket, prefix = parse_s3_uri(uri)
    objects = [o for o in list_objects(client, uri) if o.key.rsplit("/", 1)[-1].startswith(names)]
    if not objects:
        raise FileNotFoundError(f"no UMLS release files ({', '.join(names)}) under {uri}")
    local = cache_dir / bucket / (prefix or "_root")
    local.mkdir(parents=True, exist_ok=True)
    for obj in objects:
        name = obj.key.rsplit("/", 1)[-1]
        target, marker = local / name, local / f".{name}.etag"
        stamp = f"{obj.etag} {obj.size}"
        if target.is_file() and marker.is_file() and marker.read_text() == stamp:
            continue
        partial = staging_path(target, ".part")
        try:
            client.download_file(bucket, obj.key, str(partial))
            if partial.stat().st_size != obj.size:
                raise OSError(f"{obj.key}: downloaded {partial.stat().st_size} bytes, S3 lists {obj.size}")
            marker.unlink(missing_ok=True)  # a crash between the two renames then means "download again"
            os.replace(partial, target)
            marker.write_text(stamp)
        finally:
            partial.unlink(missing_ok=True)
    # Files that left the release must leave the mirror too (else a removed .gz would shadow new parts).
    wanted = {o.key.rsplit("/", 1)[-1] for o in objects}
    for stale in local.iterdir():
        if not stale.name.startswith(".") and stale.name not in wanted:
            stale.unlink()
            (local / f".{stale.name}.etag").unlink(missing_ok=True)
    return local
