"""Benchmark: the reader adapter's LoRA step and a decode step against what this machine can do, side by side.

Two probes run first, on the spot: a 2048x2048 matmul in float32 and in bfloat16 (the compute rate) and a
read of a 1 GiB tensor (the memory bandwidth). Then, with SmolLM2-135M built from its config (random weights:
the speed is the weights' shape, not their values, and nothing needs to be carried to a GPU machine):

- **fit step**: one AdamW step of the reader adapter's recipe (LoRA r 16 on every block, 8 conversations in
  micro-batches sorted by length, the loss on the last `--reply` tokens of each, bf16 autocast), in each
  variant (with and without the padding mask, float32 or bf16 frozen weights; the first step's loss is printed:
  every variant starts from the same weights, so the losses agree to bf16 rounding); its bound is the shipped
  step's FLOPs (torch's FlopCounterMode: every matmul and attention of the forward and backward) at the bf16 rate;
- **decode step**: one token for 1 and for 24 rows over `--context` tokens of cache, as `TransformersChatModel`
  decodes (its in-place cache, left-padded rows, a mask), in float32 and in bfloat16 weights; its bound is the
  bytes a step must read (every weight once, the tied embedding once more as the LM head, and every row's keys
  and values) at the measured bandwidth.

Every time is the median of `--repeats`; the variants alternate, so that a drifting machine load hits each alike.
The ratio column is measured / bound: 1.0 would be the hardware's limit.

    .venv/bin/python benchmarks/clock_bounds.py [--threads 2] [--compile] [--device cpu]

`--compile` adds the fit step under torch.compile (Inductor, one shape per micro-batch); its first step, in the
note column, includes the compilation. Runs with the device machine's python3 too (torch, transformers, peft; no medgraph install).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from medgraph.llm.hf import _growing_cache  # the repository root is on sys.path first: run as a script

# SmolLM2-135M-Instruct's config.json (the fields that shape the compute).
SMOLLM2_135M = {"vocab_size": 49152, "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
                "num_attention_heads": 9, "num_key_value_heads": 3, "max_position_embeddings": 8192,
                "rms_norm_eps": 1e-5, "rope_theta": 100000.0, "tie_word_embeddings": True}
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def median_seconds(run: Callable[[], object], repeats: int, device: str) -> float:
    times = []
    for _ in range(repeats):
        sync(device)
        started = time.perf_counter()
        run()
        sync(device)
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def matmul_flops_per_s(dtype: torch.dtype, device: str, n: int = 2048) -> float:
    a, b = torch.randn(n, n, dtype=dtype, device=device), torch.randn(n, n, dtype=dtype, device=device)
    for _ in range(3):
        a @ b
    return 2 * n**3 / median_seconds(lambda: a @ b, 15, device)


def bandwidth_bytes_per_s(device: str, nbytes: int = 1 << 30) -> float:
    """Reading a tensor larger than any cache (a sum: one read, no write)."""
    x = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    x.sum()
    return nbytes / median_seconds(lambda: x.sum(), 7, device)


def smollm2(dtype: torch.dtype, device: str) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**SMOLLM2_135M, attn_implementation="sdpa"))
    return model.to(device=device, dtype=dtype).eval()


# --------------------------------------------------------------------------- the fit step


def lora_policy(device: str, frozen_dtype: torch.dtype) -> torch.nn.Module:
    """The reader adapter's LoRA over SmolLM2; LoRA weights float32 (the optimizer's master weights), the frozen
    base in `frozen_dtype`."""
    from peft import LoraConfig, get_peft_model

    model = smollm2(frozen_dtype, device)
    torch.manual_seed(0)
    model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, bias="none",
                                             target_modules=LORA_TARGETS, task_type="CAUSAL_LM"))
    for parameter in model.parameters():
        if parameter.requires_grad:
            parameter.data = parameter.data.float()
    return model.train()


def micro_batches(lengths: list[int], reply: int, micro: int | str, device: str) -> list[tuple[torch.Tensor, ...]]:
    """Right-padded micro-batches of like lengths, the kept positions (the replies') and their targets. `micro`:
    rows per micro-batch, or "<N> tokens": as many rows as fit in N padded tokens (`medgraph.rl.sft.micro_batches`,
    restated here so that this script needs no medgraph.rl)."""
    generator = torch.Generator().manual_seed(0)
    rows = [torch.randint(0, SMOLLM2_135M["vocab_size"], (n,), generator=generator) for n in sorted(lengths)]
    chunks: list[list[torch.Tensor]] = []
    budget = int(micro.split()[0]) if isinstance(micro, str) else None
    for row in rows:  # ascending: `row` is the longest of its micro-batch
        if chunks and (len(chunks[-1]) < micro if budget is None else (len(chunks[-1]) + 1) * len(row) <= budget):
            chunks[-1].append(row)
        else:
            chunks.append([row])
    batches = []
    for chunk in chunks:
        width = max(len(r) for r in chunk)
        ids = torch.zeros(len(chunk), width, dtype=torch.long)
        attention = torch.zeros_like(ids)
        mask = torch.zeros_like(ids, dtype=torch.float32)
        for i, r in enumerate(chunk):
            ids[i, :len(r)], attention[i, :len(r)], mask[i, len(r) - reply:len(r)] = r, 1, 1.0
        keep = mask[:, 1:].any(0).nonzero().squeeze(1)
        batches.append(tuple(t.to(device) for t in (ids, attention, keep, ids[:, keep + 1], mask[:, keep + 1])))
    return batches


def fit_step(model: torch.nn.Module, forward: Callable, batches: list, optimizer: torch.optim.Optimizer,
             device: str, masked: bool = False) -> float:
    optimizer.zero_grad(set_to_none=True)
    tokens = sum(float(b[4].sum()) for b in batches)
    total = 0.0
    for ids, attention, keep, targets, mask in batches:
        with torch.autocast(torch.device(device).type, dtype=torch.bfloat16):
            logits = forward(input_ids=ids, attention_mask=attention if masked else None, logits_to_keep=keep,
                             use_cache=False).logits
        logits = logits.float()
        logp = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - logits.logsumexp(-1)
        loss = -(logp * mask).sum() / tokens
        loss.backward()
        total += float(loss.detach())
    optimizer.step()
    return total


# name -> (frozen weights' dtype, padding mask passed, micro-batch size, LoRA update in one addmm, compiled)
FIT_VARIANTS = {"fp32 weights, padding mask, micro-batches of 4, PEFT's forward (before)":
                (torch.float32, True, 4, False, False),
                "fp32 weights, causal only, micro-batches of 2, PEFT's forward": (torch.float32, False, 2, False, False),
                "fp32 weights, causal only, micro-batches of 2, one addmm": (torch.float32, False, 2, True, False),
                "fp32 weights, causal only, micro-batches of 1, one addmm": (torch.float32, False, 1, True, False),
                "fp32 weights, causal only, micro-batches within 2,048 padded tokens, one addmm (shipped)":
                (torch.float32, False, "2048 tokens", True, False),
                "bf16 frozen weights, causal only, micro-batches of 2, one addmm": (torch.bfloat16, False, 2, True, False)}
COMPILED = {"bf16 frozen weights, causal only, micro-batches of 2, one addmm, torch.compile":
            (torch.bfloat16, False, 2, True, True)}


def fit_variants(args: argparse.Namespace) -> dict[str, tuple[torch.nn.Module, Callable, bool, list]]:
    """name -> (model, its forward, padding mask passed, micro-batches)."""
    lengths = [int(n) for n in args.lengths.split(",")]
    built = {}
    variants = {**FIT_VARIANTS, **(COMPILED if args.compile else {})}
    chosen = [part.strip() for part in args.variants.split(";")] if args.variants else []
    for name, (dtype, masked, micro, fused, compiled) in variants.items():
        if chosen and not any(part in name for part in chosen):
            continue
        model = lora_policy(args.device, dtype)
        if fused:
            from medgraph.llm.lora import fuse_lora_updates

            fuse_lora_updates(model)
        built[name] = (model, torch.compile(model, dynamic=False) if compiled else model, masked,
                       micro_batches(lengths, args.reply, micro, args.device))
    return built


def fit_rows(args: argparse.Namespace, bf16_rate: float) -> list[tuple[str, float, float, str]]:
    from torch.utils.flop_counter import FlopCounterMode

    rows = []
    timings: dict[str, list[float]] = {}
    built = fit_variants(args)
    optimizers = {name: torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
                  for name, (model, *_) in built.items()}
    notes = {}
    for name, (model, forward, masked, batches) in built.items():  # a first step: allocation, kernels, compiling
        started = time.perf_counter()
        loss = fit_step(model, forward, batches, optimizers[name], args.device, masked)
        notes[name] = f"first step {time.perf_counter() - started:.1f} s, loss {loss:.5f}"
    counter = FlopCounterMode(display=False)
    # The bound counts the shipped variant's work (no FLOPs spent on padding-masked attention beyond it).
    shipped = next((name for name in built if "shipped" in name), next(iter(built)))
    model, forward, masked, batches = built[shipped]
    with counter:
        fit_step(model, forward, batches, optimizers[shipped], args.device, masked)
    flops = counter.get_total_flops()
    for _ in range(args.repeats):
        for name, (model, forward, masked, batches) in built.items():
            timings.setdefault(name, []).append(median_seconds(
                lambda m=model, f=forward, b=batches, o=optimizers[name], k=masked: fit_step(m, f, b, o, args.device, k),
                1, args.device))
    bound = flops / bf16_rate
    tokens = sum(int(n) for n in args.lengths.split(","))
    for name, times in timings.items():
        rows.append((f"fit step ({tokens} tokens, {flops / 1e12:.2f} TFLOP): {name}", statistics.median(times), bound,
                     notes[name]))
    return rows


# --------------------------------------------------------------------------- the decode step


def decode_bytes(model: torch.nn.Module, rows: int, context: int) -> int:
    """What one decode step must read: every weight once (the tied embedding again as the LM head, a row each
    for the embedding look-up aside), and every row's keys and values."""
    config = model.config
    element = next(model.parameters()).element_size()
    weights = sum(p.numel() for p in model.parameters()) * element
    if config.tie_word_embeddings:
        weights += model.get_input_embeddings().weight.numel() * element
    head_dim = config.hidden_size // config.num_attention_heads
    cache = rows * context * config.num_hidden_layers * 2 * config.num_key_value_heads * head_dim * element
    return weights + cache


@torch.inference_mode()
def decode_step_s(model: torch.nn.Module, rows: int, context: int, repeats: int, device: str) -> float:
    """One batched decode step as `TransformersChatModel._decode` takes it: the rows' caches joined left-padded
    (lengths context-rows+1 .. context) into the in-place buffer, a mask, each row's own positions."""
    config = model.config
    head_dim = config.hidden_size // config.num_attention_heads
    dtype = next(model.parameters()).dtype
    lengths = [context - i for i in range(rows)]
    layers = [[(torch.randn(1, config.num_key_value_heads, n, head_dim, dtype=dtype, device=device),) * 2
               for n in lengths] for _ in range(config.num_hidden_layers)]
    mask = torch.tensor([[0] * (context - n) + [1] * n for n in lengths], device=device)
    tokens = torch.randint(0, config.vocab_size, (rows, 1), device=device)
    positions = torch.tensor(lengths, device=device)[:, None]
    steps = 8

    def run() -> None:
        cache = _growing_cache(layers, context, steps, config)
        step_mask = mask
        for k in range(steps):
            step_mask = torch.cat([step_mask, step_mask.new_ones(rows, 1)], dim=1)
            model(input_ids=tokens, attention_mask=step_mask, position_ids=positions + k, cache=cache, use_cache=True)

    run()
    setup = median_seconds(lambda: _growing_cache(layers, context, steps, config), repeats, device)
    return (median_seconds(run, repeats, device) - setup) / steps


def decode_rows(args: argparse.Namespace, bandwidth: float) -> list[tuple[str, float, float, str]]:
    rows = []
    models = {name: smollm2(dtype, args.device) for name, dtype in (("float32", torch.float32),
                                                                     ("bfloat16", torch.bfloat16))}
    for batch in (1, 24):
        for name, model in models.items():
            seconds = decode_step_s(model, batch, args.context, args.repeats, args.device)
            nbytes = decode_bytes(model, batch, args.context)
            rows.append((f"decode step, {batch} row(s) x {args.context} tokens, {name} weights", seconds,
                         nbytes / bandwidth, f"{nbytes / 1e6:.0f} MB read"))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--lengths", default="120,150,200,300,350,420,500,550",
                        help="token lengths of the step's 8 conversations (the reader's mix: ~2,600 tokens)")
    parser.add_argument("--reply", type=int, default=40, help="trained tokens at the end of each conversation")
    parser.add_argument("--context", type=int, default=480, help="tokens of cache per decoding row")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--compile", action="store_true", help="add the fit step under torch.compile (minutes)")
    parser.add_argument("--skip-fit", action="store_true")
    parser.add_argument("--skip-decode", action="store_true")
    parser.add_argument("--variants", default="", help="only the fit variants whose names hold one of these "
                        ";-separated phrases; run one alone to read its peak memory (printed last)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    fp32_rate = matmul_flops_per_s(torch.float32, args.device)
    bf16_rate = matmul_flops_per_s(torch.bfloat16, args.device)
    bandwidth = bandwidth_bytes_per_s(args.device)
    print(f"torch {torch.__version__}, {args.device}, {torch.get_num_threads()} threads: matmul 2048^2 "
          f"{fp32_rate / 1e9:.0f} GFLOP/s float32, {bf16_rate / 1e9:.0f} GFLOP/s bfloat16; "
          f"read {bandwidth / 1e9:.1f} GB/s", flush=True)
    print("| what | measured | bound | measured / bound | note |\n|---|---|---|---|---|", flush=True)
    rows = [] if args.skip_fit else fit_rows(args, bf16_rate)
    rows += [] if args.skip_decode else decode_rows(args, bandwidth)
    for name, seconds, bound, note in rows:
        unit, scale = ("s", 1) if seconds > 1 else ("ms", 1000)
        print(f"| {name} | {seconds * scale:.1f} {unit} | {bound * scale:.1f} {unit} | {seconds / bound:.1f}x "
              f"| {note} |", flush=True)
    import resource

    print(f"peak resident memory of this process: {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6:.2f} GB")


if __name__ == "__main__":
    main()
