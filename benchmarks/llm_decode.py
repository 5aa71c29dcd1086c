"""Benchmark: a decode step with the keys/values written in place vs appended by concatenation (SmolLM2, CPU).

The evaluations spend most of their LLM time decoding, not prefilling (a demo run of 2026-12-04: ~219k prompt tokens
computed against ~52k generated, in 39 minutes of evaluation), and a decode step's cost grows with the cache it
attends over. transformers' DynamicLayer appends each step's token with torch.cat, which allocates and copies
the whole cache (rows x context) at every step; `TransformersChatModel` reserves room for the reply once and
writes each step in place (`medgraph.llm.hf._GrowingLayer`). Side by side in one process, for each batch size
and context length: milliseconds per decode step with each cache (best of --repeats), the ratio, the seconds of
a call whose prompts are cached up to their last token (an agent's next turn: the cached keys/values are copied
into the decode batch), and whether the greedy replies are identical.

Rows share one long start (prefilled once through the prefix cache) and each asks for an essay, so most rows
decode all --steps tokens; the step time is (time with --steps new tokens - time with 1) / (steps - 1).

    .venv/bin/python benchmarks/llm_decode.py [--home .medgraph] [--batches 1,8,24] [--contexts 400,1900]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from unittest import mock

import torch

from medgraph.llm import GenerationConfig, hf, load_llm, user

QUESTION = "Which of the following has the mechanism of action Factor Xa Inhibitors? A. x B. y C. z D. w. "


class ConcatenatingLayer(hf._GrowingLayer):
    """What transformers' DynamicLayer does: a new tensor (the whole cache copied) at every step."""

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: object,
               **kwargs: object) -> tuple[torch.Tensor, torch.Tensor]:
        self._keys = torch.cat([self.keys, key_states], dim=-2)
        self._values = torch.cat([self.values, value_states], dim=-2)
        self._filled(self._keys.shape[-2])
        return self.keys, self.values


def step_ms(llm: hf.TransformersChatModel, conversations: list, steps: int) -> tuple[float, float, list[str], int]:
    """Milliseconds per decode step, seconds of a call whose prompts are all cached but their last token (what an
    agent's next turn pays before decoding), the replies, and the fewest tokens any row generated."""
    llm.generate(conversations, GenerationConfig(max_new_tokens=1))  # the shared start into the prefix cache
    started = time.perf_counter()
    llm.generate(conversations, GenerationConfig(max_new_tokens=1))
    prefill = time.perf_counter() - started
    started = time.perf_counter()
    replies = llm.generate(conversations, GenerationConfig(max_new_tokens=steps))
    decode = time.perf_counter() - started - prefill
    longest = max(r.completion_tokens for r in replies)
    return (1000 * decode / max(longest - 1, 1), prefill, [r.text for r in replies],
            min(r.completion_tokens for r in replies))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--home", type=Path, default=Path(".medgraph"), help="where the built-in LLM is converted")
    parser.add_argument("--batches", default="1,8,24")
    parser.add_argument("--contexts", default="400,1900", help="approximate prompt tokens per row")
    parser.add_argument("--steps", type=int, default=33)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    llm = load_llm("smollm2-135m-instruct", home=args.home, device="cpu", dtype="float32", max_batch_size=64)
    print(f"SmolLM2-135M float32, {args.threads} torch threads, {args.steps} new tokens, best of {args.repeats}")
    print("| rows | prompt tokens | in place ms/step | concatenated ms/step | speed-up | cached-prompt call s, in place "
          "| concatenated | same replies | fewest tokens |")
    print("|---|---|---|---|---|---|---|---|---|")
    for context in (int(c) for c in args.contexts.split(",")):
        start = QUESTION * max(1, context // 26)
        for rows in (int(b) for b in args.batches.split(",")):
            conversations = [[user(f"{start}Question {i}: write a long essay about it.")] for i in range(rows)]
            best: dict[str, float] = {}
            best_prefill: dict[str, float] = {}
            replies: dict[str, list[str]] = {}
            fewest = args.steps
            for _ in range(args.repeats):  # interleaved, so that a drifting machine load affects both alike
                for variant, layer in (("in place", hf._GrowingLayer), ("concatenated", ConcatenatingLayer)):
                    with mock.patch.object(hf, "_GrowingLayer", layer):
                        ms, prefill, replies[variant], least = step_ms(llm, conversations, args.steps)
                    best[variant] = min(best.get(variant, ms), ms)
                    best_prefill[variant] = min(best_prefill.get(variant, prefill), prefill)
                    fewest = min(fewest, least)
                    llm.clear_prefix_cache()
            tokens = llm.generate(conversations[:1], GenerationConfig(max_new_tokens=1))[0].prompt_tokens
            same = sum(a == b for a, b in zip(replies["in place"], replies["concatenated"], strict=True))
            print(f"| {rows} | {tokens} | {best['in place']:.0f} | {best['concatenated']:.0f} "
                  f"| {best['concatenated'] / best['in place']:.2f}x | {best_prefill['in place']:.2f} "
                  f"| {best_prefill['concatenated']:.2f} | {same}/{rows} | {fewest} |", flush=True)


if __name__ == "__main__":
    main()
