"""UMLS Metathesaurus releases: layouts, discovery, ingestion, checks, sample builder."""
