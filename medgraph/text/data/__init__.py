"""Packaged data of the text corpus: the PubMedQA abstracts and their licence (see build_pubmedqa_corpus.py)."""
