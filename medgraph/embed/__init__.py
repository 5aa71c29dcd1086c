"""Text embeddings: encoder wrapper, incremental embedding tables, ANN index (FAISS)."""
