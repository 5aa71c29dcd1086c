"""The `medgraph` command line."""

from __future__ import annotations

from pathlib import Path

import pytest

from medgraph.cli import main


def test_status_before_anything_is_built_says_so(medgraph_home: Path, capsys: pytest.CaptureFixture):
    assert main(["status"]) == 1
    out = capsys.readouterr().out
    assert str(medgraph_home) in out and "not built yet" in out


def test_status_lists_tables_with_row_counts(medgraph_home: Path, warehouse, release_copy: Path,
                                             capsys: pytest.CaptureFixture):
    from conftest import ingest_release

    ingest_release(release_copy, warehouse)
    assert main(["status"]) == 0
    out = capsys.readouterr().out
    assert f"umls.mrsty{' ' * 30}" in out
    assert f"{warehouse.count('umls.mrrel'):,} rows" in out
