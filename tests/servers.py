"""Throwaway servers for tests (a PostgreSQL cluster, an MLflow tracking server) and the helpers to start
any server subprocess on loopback: a free port, a readiness wait, a clean stop."""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_until_ready(proc: subprocess.Popen, ready: Callable[[], bool], what: str, timeout_s: float,
                     output: Callable[[], str], interval_s: float = 0.5) -> None:
    """Poll `ready()` until it is true; fail with the server's output if it exits or the time runs out."""
    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode}:\n{output()[-3000:]}")
        try:
            if ready():
                return
        except OSError:  # not listening yet (requests' and urllib's errors are OSErrors)
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} did not become ready in {timeout_s:.0f} s:\n{output()[-3000:]}")
        time.sleep(interval_s)


def stop(proc: subprocess.Popen, timeout_s: float = 20) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()


def postgres_bin_dir() -> Path | None:
    """Where initdb/pg_ctl live: on PATH, else the newest Debian /usr/lib/postgresql/<v>/bin."""
    found = shutil.which("initdb")
    if found and shutil.which("pg_ctl"):
        return Path(os.path.realpath(found)).parent
    candidates = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"), key=lambda p: int(p.split("/")[4]))
    return Path(candidates[-1]).parent if candidates else None


@dataclass(frozen=True)
class Postgres:
    host: str
    port: int
    user: str
    password: str

    def url(self, database: str) -> str:
        # psycopg2 explicitly: SQLAlchemy 2.1 would pick psycopg (3) for a bare postgresql://.
        return f"postgresql+psycopg2://{self.user}:{self.password}@{self.host}:{self.port}/{database}"

    def create_database(self, name: str) -> None:
        import psycopg2

        con = psycopg2.connect(host=self.host, port=self.port, user=self.user, password=self.password,
                               dbname="postgres")
        con.autocommit = True
        with con.cursor() as cur:
            cur.execute(f'CREATE DATABASE "{name}"')
        con.close()

    def query(self, database: str, sql: str) -> list[tuple]:
        import psycopg2

        con = psycopg2.connect(host=self.host, port=self.port, user=self.user, password=self.password,
                               dbname=database)
        try:
            with con.cursor() as cur:
                cur.execute(sql)
                return cur.fetchall()
        finally:
            con.close()


@contextmanager
def postgres_server(password: str = "pg-test-password") -> Iterator[Postgres]:
    """A fresh cluster in a temporary directory on a free port, password-authenticated, stopped afterwards.

    PostgreSQL refuses to run as root: as root, the server runs as the `postgres` system user that the
    Debian package creates (the directory is made theirs)."""
    bin_dir = postgres_bin_dir()
    if bin_dir is None:
        pytest.skip("PostgreSQL server binaries (initdb, pg_ctl) not found: install the Debian package "
                    "'postgresql' (.ci/run does so when it runs as root)")
    pytest.importorskip("psycopg2", reason="psycopg2 is not installed (pip install -e '.[dev]')")
    run_as = None
    if os.geteuid() == 0:
        try:
            run_as = pwd.getpwnam("postgres")
        except KeyError:
            pytest.skip("running as root and no 'postgres' user to run the PostgreSQL server as")
    root = Path(tempfile.mkdtemp(prefix="medgraph-pg-"))
    data, pwfile, log = root / "data", root / "pwfile", root / "server.log"
    pwfile.write_text(password)
    if run_as:
        for path in (root, pwfile):
            os.chown(path, run_as.pw_uid, run_as.pw_gid)

    def as_server_user() -> None:
        if run_as:
            os.setgid(run_as.pw_gid)
            os.setuid(run_as.pw_uid)

    def run(*args: str) -> None:
        proc = subprocess.run([str(bin_dir / args[0]), *args[1:]], capture_output=True, text=True,
                              preexec_fn=as_server_user, cwd=root, check=False)
        if proc.returncode != 0:
            detail = log.read_text()[-2000:] if log.exists() else ""
            raise RuntimeError(f"{args[0]} failed: {proc.stderr[-2000:]}\n{detail}")

    port = free_port()
    run("initdb", "-D", str(data), "-U", "medgraph", "--auth=scram-sha-256", f"--pwfile={pwfile}",
        "--encoding=UTF8", "--no-sync")
    run("pg_ctl", "-D", str(data), "-l", str(log), "-w", "-t", "60",
        "-o", f"-p {port} -k {root} -c listen_addresses=127.0.0.1 -c fsync=off", "start")
    try:
        yield Postgres("127.0.0.1", port, "medgraph", password)
    finally:
        run("pg_ctl", "-D", str(data), "-m", "immediate", "-w", "stop")
        shutil.rmtree(root, ignore_errors=True)


@contextmanager
def mlflow_server(backend_store_uri: str, artifacts: Path) -> Iterator[str]:
    """`mlflow server` as a subprocess on loopback; yields its URL once /health answers."""
    port = free_port()
    log = artifacts.parent / f"mlflow-server-{port}.log"
    env = {**os.environ, "MLFLOW_DISABLE_TELEMETRY": "true"}
    with log.open("w") as out:
        proc = subprocess.Popen(
            [str(Path(sys.executable).parent / "mlflow"), "server", "--host", "127.0.0.1", "--port", str(port),
             "--backend-store-uri", backend_store_uri, "--artifacts-destination", str(artifacts),
             "--workers", "1"],
            stdout=out, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"

    def healthy() -> bool:
        with urllib.request.urlopen(f"{url}/health", timeout=2) as response:
            return response.status == 200

    try:
        wait_until_ready(proc, healthy, "mlflow server", 120, log.read_text)
        yield url
    finally:
        stop(proc)
