"""The text side: corpus documents and token chunks, BM25 (DuckDB fts), chunk–concept mentions and links."""
