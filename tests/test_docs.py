"""The docs describe the present, briefly (issue 57): a short README, one current result per benchmark, and no
commit ids standing in for an explanation (history is in git and CHANGELOG.md)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# A commit id as people paste them: 7-40 lowercase hex characters with at least one letter and one digit.
COMMIT_ID = re.compile(r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}\b")
CODE = ("medgraph", "platform_assets", "resources", "jobs", "sensors", "benchmarks")


def test_the_readme_is_a_guide_and_the_benchmarks_readme_holds_current_results():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 150
    assert len((ROOT / "benchmarks" / "README.md").read_text().splitlines()) <= 400
    assert (ROOT / "CHANGELOG.md").is_file()


def test_no_commit_id_in_the_docs_or_the_code():
    texts = [ROOT / "README.md", ROOT / "docs" / "ARCHITECTURE.md", ROOT / "docs" / "GUIDE.md",
             ROOT / "benchmarks" / "README.md", *[p for package in CODE for p in (ROOT / package).rglob("*.py")]]
    found = [f"{path.relative_to(ROOT)}:{number}: {match}" for path in texts
             for number, line in enumerate(path.read_text().splitlines(), start=1) for match in COMMIT_ID.findall(line)]
    assert found == []
    assert COMMIT_ID.findall("fixed in 0e685ca") == ["0e685ca"]  # the pattern finds one
