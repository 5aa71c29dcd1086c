"""LoRA layers for training on a CPU: PEFT's layers with their update added in one kernel.

Lives beside the chat model (not in `medgraph.rl`) so that benchmarks/clock_bounds.py can use it on a machine
without the platform's other dependencies.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator

import torch
from torch import nn


def fuse_lora_updates(model: nn.Module) -> int:
    """Give every plain LoRA linear layer of `model` a forward that adds its update in one `addmm` (the same
    function, rounded once instead of twice); returns how many layers it changed.

    PEFT computes `base(x) + lora_B(lora_A(x)) * scaling`: the scaled update and the sum are two more passes
    over a (tokens x out_features) activation, and it first casts `x` to the adapter's float32 (which autocast
    casts back). On a CPU those passes, not the matmuls, set the pace of a LoRA step (benchmarks/README.md
    `clock_bounds.py`)."""
    from peft.tuners.lora.layer import Linear as LoraLinear

    fused = 0
    for module in model.modules():
        if type(module) is LoraLinear:
            module.__class__ = _addmm_lora_linear()
            fused += 1
    return fused


@functools.cache
def _addmm_lora_linear() -> type:
    """The class, made on first use: peft is imported only by processes that train."""
    from peft.tuners.lora.layer import Linear as LoraLinear

    class AddmmLoraLinear(LoraLinear):
        """PEFT's LoRA Linear whose single plain adapter (no dropout, no DoRA-like variant) adds
        `scaling * (x A^T) B^T` to the frozen layer's output in one addmm; anything else is PEFT's forward."""

        def forward(self, x: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
            active = [a for a in self.active_adapters if a in self.lora_A]
            if (self.disable_adapters or self.merged or kwargs.get("adapter_names") is not None
                    or len(active) != 1 or active[0] in self.lora_variant
                    or not isinstance(self.lora_dropout[active[0]], nn.Identity)):
                return super().forward(x, *args, **kwargs)
            name = active[0]
            result = self.base_layer(x, *args, **kwargs)
            down = self.lora_A[name](x)
            flat = torch.addmm(result.reshape(-1, result.shape[-1]), down.reshape(-1, down.shape[-1]),
                               self.lora_B[name].weight.t(), alpha=self.scaling[name])
            return flat.view(result.shape)

    return AddmmLoraLinear


@contextlib.contextmanager
def frozen_linears_in_bf16(model: nn.Module, enabled: bool = True) -> Iterator[int]:
    """Within the block, the frozen `nn.Linear` weights of `model` are stored in bfloat16; the float32 ones come
    back on exit (merging an adapter and evaluating read them). Yields how many layers it changed.

    For passes under bf16 autocast only: autocast casts a Linear's weight to bf16 at every use and caches the cast
    only for weights that require grad, so each micro-batch of a LoRA fit re-cast the whole frozen model. Stored
    in bf16 the numbers are the same and the cast is gone. A weight tied to the input embeddings (SmolLM2's LM
    head) stays: the embedding lookup is not autocast."""
    if not enabled:
        yield 0
        return
    embedding = model.get_input_embeddings().weight
    kept: dict[nn.Linear, nn.Parameter] = {}
    for module in model.modules():
        if type(module) is nn.Linear and not module.weight.requires_grad and module.weight is not embedding:
            kept[module] = module.weight
            module.weight = nn.Parameter(module.weight.detach().to(torch.bfloat16), requires_grad=False)
    try:
        yield len(kept)
    finally:
        for module, weight in kept.items():
            module.weight = weight
