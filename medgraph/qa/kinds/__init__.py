"""One module per question type, each with `drafts(graph, rng)`: the questions of that type, one at a time."""
