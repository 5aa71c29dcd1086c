"""Micro-batches in draw order vs sorted by length (`medgraph.rl.sft.fit_replies`), on the reader adapter's examples.

`fit_replies` splits each batch of conversations into micro-batches and pads each micro-batch to its longest
conversation. The reader's examples mix ~120-token prompts (kg_facts, a2rag) with ~550-token ones (rag_kg: rag-kg's
facts and passages), so a micro-batch in draw order is often padded to a long one. Sorting each batch by length
first changes nothing in the loss (it sums over target tokens across the micro-batches) and only what is padded.

Prints, over the batches `fit_replies` draws for `--steps` steps (the same seeded epochs): the padded tokens in draw
order and sorted, and, for `--timed-steps` of those batches, the seconds of one forward and backward pass of the
LoRA reader over the micro-batches in each order, the two orders alternating batch by batch (one run, same
machine state).

    .venv/bin/python benchmarks/microbatch_order.py --home .medgraph --timed-steps 6
"""

from __future__ import annotations

import argparse
import itertools
import time
from pathlib import Path

import torch

from medgraph.rl.reader import DEFAULT_LAYOUTS, DEMO_FIT, layouts_text, parse_layouts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--home", type=Path, default=Path(".medgraph"), help="a `make demo` home")
    parser.add_argument("--llm", default="smollm2-135m-instruct")
    parser.add_argument("--layouts", default=layouts_text(DEFAULT_LAYOUTS))
    parser.add_argument("--steps", type=int, default=DEMO_FIT.steps)
    parser.add_argument("--timed-steps", type=int, default=6)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    from medgraph.embed.encoder import load_encoder
    from medgraph.llm import load_llm
    from medgraph.llm.models import builtin_model_dir
    from medgraph.methods.tools import KnowledgeTools
    from medgraph.qa.table import load_qa_items
    from medgraph.retrieval import Retriever
    from medgraph.rl.model import load_trainable, lora_of, make_batch, token_logprobs
    from medgraph.rl.reader import ReaderConfig, held_out_pairs, reader_examples
    from medgraph.rl.rollout import encode_conversation
    from medgraph.rl.sft import drawn_batches
    from medgraph.storage import Lake, Warehouse

    warehouse = Warehouse(args.home / "warehouse.duckdb", Lake(args.home / "lake"))
    config = ReaderConfig(layouts=parse_layouts(args.layouts))
    train = load_qa_items(warehouse, "train")
    held_out = held_out_pairs([*load_qa_items(warehouse, "validation"), *load_qa_items(warehouse, "test")])
    base = load_llm(args.llm, home=args.home)
    with Retriever(warehouse, load_encoder("minilm")) as retriever:
        examples, _ = reader_examples(retriever.graph, train, config, held_out, count_tokens=base.count_tokens,
                                      tools=KnowledgeTools(retriever))
    reader = load_trainable(builtin_model_dir(args.llm, args.home), lora=lora_of(config.fit), device="cpu",
                            max_batch_size=64)
    encoded = [encode_conversation(reader.tokenizer, e.conversation, reader.eos_ids) for e in examples]

    fit = config.fit
    batches = list(itertools.islice(drawn_batches(len(encoded), fit.batch_size, fit.seed), args.steps))
    micro = fit.micro_batch_size

    def padded(batch: list[int]) -> int:
        return sum(len(chunk) * max(len(encoded[i].ids) for i in chunk)
                   for chunk in (batch[s:s + micro] for s in range(0, len(batch), micro)))

    def by_length(batch: list[int]) -> list[int]:
        return sorted(batch, key=lambda i: len(encoded[i].ids))

    real = sum(len(encoded[i].ids) for batch in batches for i in batch)
    in_order = sum(padded(batch) for batch in batches)
    in_sorted = sum(padded(by_length(batch)) for batch in batches)
    print(f"{len(examples)} examples, {args.steps} batches of {fit.batch_size} in micro-batches of {micro}: "
          f"{real:,} real tokens; padded in draw order {in_order:,}, sorted {in_sorted:,} "
          f"(sorted / draw order {in_sorted / in_order:.3f})")

    def step_seconds(batch: list[int]) -> float:
        started = time.perf_counter()
        for s in range(0, len(batch), micro):
            tokens = make_batch([encoded[i] for i in batch[s:s + micro]], reader.pad_id, reader.device)
            (-(token_logprobs(reader.model, tokens) * tokens.mask).sum()).backward()
        reader.model.zero_grad(set_to_none=True)
        return time.perf_counter() - started

    reader.model.train()
    timed = {"draw order": 0.0, "sorted": 0.0}
    for k, batch in enumerate(batches[: args.timed_steps]):
        orders = [("draw order", batch), ("sorted", by_length(batch))]
        for name, ordered in orders if k % 2 else orders[::-1]:  # each order goes first every other batch
            timed[name] += step_seconds(ordered)
    if args.timed_steps:
        print(f"{args.timed_steps} batches, forward + backward: draw order {timed['draw order']:.1f} s, sorted "
              f"{timed['sorted']:.1f} s (sorted / draw order {timed['sorted'] / timed['draw order']:.3f})")


if __name__ == "__main__":
    main()
