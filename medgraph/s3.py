"""S3 for the lake and the UMLS release: URIs, DuckDB's httpfs, atomic publishing, a local release cache.

DuckDB reads and writes the lake's Parquet files on S3 itself (httpfs, loaded
from the `duckdb-extension-httpfs` package file: `INSTALL httpfs` by name would
go to the internet). boto3 does what DuckDB cannot: the server-side copy that
publishes a table, deletes, sizes, listings and release downloads. The client
is passed in (a dagster-aws `S3Resource` builds it in deployments), so this
module knows nothing about Dagster.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import re
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import duckdb

_S3_URI = re.compile(r"^s3://(?P<bucket>[a-z0-9][a-z0-9.\-]{1,61}[a-z0-9])(?:/(?P<prefix>.*))?$")


class S3UriError(ValueError):
    """A string that should be `s3://bucket[/prefix]` is not."""


class LakeNotLocalError(NotImplementedError):
    """A step that keeps local files beside the lake's tables ran with the lake on S3."""


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
        return self._uri(schema, f"{table}.parquet")

    def staging_path(self, schema: str, table: str) -> str:
        return self._uri(".staging", schema, f"{table}.{uuid.uuid4().hex[:12]}.parquet")

    def publish(self, staging: str, schema: str, table: str) -> str:
        final = self.table_path(schema, table)
        # client.copy is boto3's managed copy: multipart server-side copy beyond 5 GB, still atomic at the end.
        self.client.copy({"Bucket": self.bucket, "Key": self._key(staging)}, self.bucket, self._key(final))
        self.client.delete_object(Bucket=self.bucket, Key=self._key(staging))
        return final

    def discard(self, staging: str) -> None:
        self.client.delete_object(Bucket=self.bucket, Key=self._key(staging))  # no error when absent

    def size(self, path: str) -> int:
        return int(self.client.head_object(Bucket=self.bucket, Key=self._key(path))["ContentLength"])

    def exists(self, path: str) -> bool:
        listed = self.client.list_objects_v2(Bucket=self.bucket, Prefix=self._key(path), MaxKeys=1)
        return any(o["Key"] == self._key(path) for o in listed.get("Contents", []))

    @property
    def root(self) -> Path:
        # Steps that still treat the lake as a directory (embedding tables read with pyarrow, FAISS index and
        # CSR cache files beside them) must fail with this, not with an AttributeError deep inside.
        raise LakeNotLocalError(
            f"this step reads or writes files directly under the lake directory, and the lake is {self.uri}: "
            "on S3 the UMLS tables, the dbt KG marts and the evaluation tables are supported; run the "
            "embedding, text and model assets with a local lake (unset MEDGRAPH_LAKE) for now")

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
        partial = local / f".{name}.{uuid.uuid4().hex[:8]}.part"
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
