"""Questions: the type every layer above speaks, its file formats, its table and its generation from the KG.

    item        QaItem and the accessors of what a KG-derived item carries (gold path, pairs, facts)
    mirage      the MIRAGE JSON format, read and written
    benchmarks  benchmark specs (kg, mirage:, pubmedqa:, jsonl:) and the PubMedQA / JSONL readers
    table       the `qa.qa_items` table: its schema, writer and reader
    generate    questions drafted from `kg.*` with verifiable answers, split leak-free by fact

It sits on the data layer (umls, kg, text, embed): nothing here imports the methods, training or evaluation.
"""
