"""Benchmark: the whole UMLS ingestion (MRCONSO, MRREL, MRSTY, MRDEF, MRSAB) into a local and an S3 lake.

Why: sizing a full release ("Running at scale" in the README). It ingests a
synthetic release of real layout (medgraph.umls.synthetic) with the default
filters, once into a local lake and once into an S3 lake on moto's standalone
server on loopback (a Python S3 emulator: its numbers bound the cost of
the S3 code path here, they are not AWS's throughput), and extrapolates the
local rate linearly to a full release (MRREL ~104.6M rows; the other files
scale with it as in a real release). Memory stays flat in the file size
(benchmarks/README.md, ingest_rrf.py), so linear extrapolation is the model.

    .venv/bin/python benchmarks/ingest_lake.py [--mrrel-rows 2000000] [--work-dir DIR] [--skip-s3]
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from pathlib import Path

FULL_RELEASE_MRREL_ROWS = 104_600_000


def ingest_all(release: Path, warehouse) -> list[tuple[str, int, int, float]]:
    from medgraph.umls.ingest import ingest_rrf_file
    from medgraph.umls.schema import INGESTED

    rows = []
    for layout in INGESTED:
        stats = ingest_rrf_file(release, layout, warehouse)
        rows.append((layout.filename, stats.rows_in, stats.bytes_in, stats.seconds))
    return rows


def report(label: str, rows: list[tuple[str, int, int, float]], mrrel_rows: int) -> float:
    print(f"\n{label}")
    print(f"{'file':<12}{'rows in':>12}{'MB in':>9}{'seconds':>9}{'rows/s':>12}")
    for name, n, size, seconds in rows:
        print(f"{name:<12}{n:>12,}{size / 1e6:>9.1f}{seconds:>9.2f}{n / seconds:>12,.0f}")
    total_rows, total_s = sum(r[1] for r in rows), sum(r[3] for r in rows)
    total_mb = sum(r[2] for r in rows) / 1e6
    print(f"{'total':<12}{total_rows:>12,}{total_mb:>9.1f}{total_s:>9.2f}{total_rows / total_s:>12,.0f}"
          f"   ({total_mb / total_s:.1f} MB/s of RRF)")
    projected = total_s * FULL_RELEASE_MRREL_ROWS / mrrel_rows
    print(f"projected full release (MRREL {FULL_RELEASE_MRREL_ROWS:,} rows, files in proportion): "
          f"{projected / 60:.1f} min")
    return projected


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mrrel-rows", type=int, default=2_000_000)
    parser.add_argument("--work-dir", type=Path, default=Path(__file__).parent / "_work" / "ingest_lake")
    parser.add_argument("--skip-s3", action="store_true")
    args = parser.parse_args()

    from medgraph.storage import Lake, Warehouse
    from medgraph.umls.synthetic import write_synthetic_release

    release = args.work_dir / f"release_{args.mrrel_rows}"
    if not (release / "MRSAB.RRF").is_file():
        write_synthetic_release(release, mrrel_rows=args.mrrel_rows)
    print(f"cores {os.cpu_count()}, load average {os.getloadavg()[0]:.1f}, synthetic release {release}")

    out = Path(tempfile.mkdtemp(dir=args.work_dir))
    try:
        local = Warehouse(out / "local" / "warehouse.duckdb", Lake(out / "local" / "lake"))
        started = time.perf_counter()
        report("local lake", ingest_all(release, local), args.mrrel_rows)
        print(f"wall {time.perf_counter() - started:.1f} s")
        if not args.skip_s3:
            import boto3
            from moto.server import ThreadedMotoServer

            from resources.warehouse import S3Access, WarehouseResource

            os.environ.update(AWS_ACCESS_KEY_ID="bench", AWS_SECRET_ACCESS_KEY="bench", AWS_DEFAULT_REGION="us-east-1")
            server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
            server.start()
            host, port = server.get_host_and_port()
            endpoint = f"http://{host}:{port}"
            boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket="bench-lake")
            remote = WarehouseResource(home=str(out / "s3"), lake="s3://bench-lake/lake",
                                       s3=S3Access(endpoint_url=endpoint)).get_warehouse()
            started = time.perf_counter()
            report("S3 lake (moto on loopback)", ingest_all(release, remote), args.mrrel_rows)
            print(f"wall {time.perf_counter() - started:.1f} s")
            server.stop()
    finally:
        shutil.rmtree(out, ignore_errors=True)
    print(f"load average at the end {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
