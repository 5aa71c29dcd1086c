"""Knowledge-graph access on DuckDB: lookup, one-hop, expansion; KG-derived QA."""
