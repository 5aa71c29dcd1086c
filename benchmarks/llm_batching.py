"""Benchmark: batched generation vs one prompt at a time, SmolLM2-135M-Instruct on the CPU.

What is measured, side by side in one run: the same 16 chat prompts (short
medical questions of different lengths, greedy decoding, --max-new-tokens) are
completed

- batched: one `TransformersChatModel.generate` call, max_batch_size 16
  (prompts prefilled unpadded, then one shrinking decode batch);
- one at a time: 16 calls of one conversation each;
- hf generate: the same 16 rows left-padded through one `model.generate`
  call (what the backend did before; every row decodes to the longest reply);
- llama.cpp (with --llamacpp, extra `llamacpp`): the same GGUF file the
  transformers backend converts from (SmolLM2's Q4_1, which transformers
  dequantizes to float32), run by llama.cpp's quantized kernels, one
  conversation after another (llama-cpp-python has no batched chat).

--context-tokens N puts ~N tokens of retrieval-style passages (different for
each question, 0.7-1.3 N) before each question, as RAG prompts have: prefill
then dominates, and it is the same work batched or not.

For each mode: wall seconds, CPU seconds of this process, generated tokens
and tokens/s (wall), then the speed-up ratio batched / one-at-a-time. The
modes run in interleaved rounds (--repeats) and each keeps its best round.
Greedy outputs must be the same in both modes; the script reports how many
rows match (float rounding under padding can, rarely, flip a near-tie).

The machine may be shared: compare the ratio within a run. On a busy 2-core
machine two torch threads spin-wait on each other; --threads 1 is the
robust setting there.

    .venv/bin/python benchmarks/llm_batching.py [--threads 1] [--max-new-tokens 32] [--repeats 2]
        [--context-tokens 1000] [--llamacpp] [--home benchmarks/_work/llm_batching/home]
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import time
from pathlib import Path

import torch

from medgraph.llm import GenerationConfig, load_llm, user
from medgraph.llm.base import ChatModel, Completion
from medgraph.llm.hf import TransformersChatModel

QUESTIONS = [
    "What is hypertension?",
    "Name two symptoms of migraine.",
    "Which organ produces insulin?",
    "What does an electrocardiogram measure?",
    "Explain in one sentence what anemia is.",
    "What class of drug is metformin, and what condition is it used for?",
    "Is asthma a disease of the lungs or of the heart?",
    "What is the usual first-line treatment for a bacterial pneumonia in an otherwise healthy adult?",
    "Define tachycardia.",
    "What vitamin deficiency causes scurvy?",
    "Which blood cells fight infections?",
    "A patient has jaundice and an enlarged liver. Which organ is most likely affected?",
    "What is the difference between type 1 and type 2 diabetes mellitus?",
    "Name a common side effect of ibuprofen.",
    "What does the abbreviation MRI stand for?",
    "Which gland is affected in hyperthyroidism, and what are two typical signs of it in adults?",
]


def prompts(context_tokens: int) -> list[str]:
    """The questions, each after its own passages of ~0.7-1.3 x context_tokens tokens (~0.75 words a token)."""
    if not context_tokens:
        return QUESTIONS
    rng = random.Random(0)
    out = []
    for question in QUESTIONS:
        words = int(context_tokens * rng.uniform(0.7, 1.3) * 0.75)
        sentences = [rng.choice(QUESTIONS).rstrip("?.") + "." for _ in range(words // 9 + 1)]
        out.append("Passages:\n" + " ".join(sentences) + f"\n\nQuestion: {question}")
    return out


def run(model: ChatModel, mode: str, config: GenerationConfig,
        texts: list[str]) -> tuple[float, float, list[Completion]]:
    conversations = [[user(text)] for text in texts]
    wall, cpu = time.perf_counter(), time.process_time()
    if mode in ("batched", "llama.cpp"):  # llama.cpp's generate runs its rows one after another
        completions = model.generate(conversations, config)
    elif mode == "one at a time":
        completions = [model.generate([c], config)[0] for c in conversations]
    else:
        completions = hf_generate(model, conversations, config)
    return time.perf_counter() - wall, time.process_time() - cpu, completions


@torch.inference_mode()
def hf_generate(model: TransformersChatModel, conversations: list, config: GenerationConfig) -> list[Completion]:
    """All rows left-padded through one transformers `generate` call (greedy)."""
    rows = [model.tokenizer(model.render(c), add_special_tokens=False)["input_ids"] for c in conversations]
    width = max(len(r) for r in rows)
    ids = torch.tensor([[model.pad_id] * (width - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    out = model.model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=config.max_new_tokens,
                               do_sample=False, pad_token_id=model.pad_id, eos_token_id=model.eos_ids)
    completions = []
    for row, tokens in zip(rows, out[:, width:].tolist(), strict=True):
        end = next((k for k, t in enumerate(tokens) if t in model.eos_ids), len(tokens))
        completions.append(Completion(model.tokenizer.decode(tokens[:end], skip_special_tokens=True), len(row),
                                      min(end + 1, len(tokens)), 0.0))
    return completions


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--context-tokens", type=int, default=0, help="passages before each question (~tokens)")
    parser.add_argument("--llamacpp", action="store_true", help="add llama.cpp on the same GGUF (extra `llamacpp`)")
    parser.add_argument("--home", type=Path, default=Path(__file__).parent / "_work" / "llm_batching" / "home")
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    started = time.perf_counter()
    model = load_llm("smollm2-135m-instruct", home=args.home, device="cpu", max_batch_size=16)
    print(f"machine: {platform.node()} {os.cpu_count()} CPUs, torch {torch.__version__}, {args.threads} thread(s); "
          f"model loaded in {time.perf_counter() - started:.1f} s ({model.name}, {model.dtype})")
    config = GenerationConfig(max_new_tokens=args.max_new_tokens)
    texts = prompts(args.context_tokens)
    run(model, "batched", GenerationConfig(max_new_tokens=2), QUESTIONS)  # warm-up: first-call allocations
    models: dict[str, ChatModel] = {"one at a time": model, "batched": model, "hf generate": model}
    if args.llamacpp:
        started = time.perf_counter()
        models["llama.cpp"] = load_llm("llamacpp:smollm2-135m-instruct", home=args.home, n_ctx=4096,
                                       n_threads=args.threads)
        print(f"llama.cpp loaded in {time.perf_counter() - started:.1f} s ({models['llama.cpp']!r})")
        run(models["llama.cpp"], "llama.cpp", GenerationConfig(max_new_tokens=2), QUESTIONS[:2])  # warm-up

    best: dict[str, tuple[float, float, list]] = {}
    for _ in range(args.repeats):
        for mode, mode_model in models.items():
            result = run(mode_model, mode, config, texts)
            if mode not in best or result[0] < best[mode][0]:
                best[mode] = result

    print(f"\n{len(QUESTIONS)} prompts (~{args.context_tokens} context tokens), greedy, "
          f"max_new_tokens={args.max_new_tokens}, best of {args.repeats}\n")
    print(f"{'mode':<15}{'wall s':>9}{'CPU s':>9}{'prompt tok':>12}{'gen tok':>9}{'gen tok/s':>11}")
    rates = {}
    for mode, (wall, cpu, completions) in best.items():
        generated = sum(c.completion_tokens for c in completions)
        prompt = sum(c.prompt_tokens for c in completions)
        rates[mode] = generated / wall
        print(f"{mode:<15}{wall:>9.2f}{cpu:>9.2f}{prompt:>12}{generated:>9}{rates[mode]:>11.1f}")
    same = sum(a.text == b.text for a, b in zip(best["batched"][2], best["one at a time"][2], strict=True))
    print(f"\nspeed-up batched / one at a time: {rates['batched'] / rates['one at a time']:.2f}x "
          f"(hf generate / one at a time: {rates['hf generate'] / rates['one at a time']:.2f}x)")
    print(f"identical greedy outputs: {same}/{len(QUESTIONS)}")
    if "llama.cpp" in best:
        same = sum(a.text == b.text for a, b in zip(best["llama.cpp"][2], best["one at a time"][2], strict=True))
        print(f"llama.cpp / transformers one at a time: {rates['llama.cpp'] / rates['one at a time']:.2f}x, "
              f"/ transformers batched: {rates['llama.cpp'] / rates['batched']:.2f}x; "
              f"identical greedy outputs: {same}/{len(QUESTIONS)}")


if __name__ == "__main__":
    main()
