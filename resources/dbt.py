"""The dbt project (KG marts) as dagster-dbt sees it. Importing this needs no manifest."""

import subprocess
import sys
from pathlib import Path

from dagster_dbt import DbtProject

DBT_PROJECT_DIR = Path(__file__).resolve().parents[1] / "dbt"

# The dbt CLI installed beside this interpreter, so an unactivated virtualenv works too.
DBT_EXECUTABLE = str(Path(sys.executable).parent / "dbt")

dbt_project = DbtProject(project_dir=DBT_PROJECT_DIR, profiles_dir=DBT_PROJECT_DIR)


def prepare_manifest() -> Path:
    """Run `dbt parse` so `target/manifest.json` exists and is current (set-up step, test session)."""
    subprocess.run(
        [DBT_EXECUTABLE, "parse", "--project-dir", str(DBT_PROJECT_DIR), "--profiles-dir", str(DBT_PROJECT_DIR),
         "--quiet"],
        check=True,
    )
    return dbt_project.manifest_path
