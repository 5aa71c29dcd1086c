"""The chat LLM (MEDGRAPH_LLM): a built-in name, a local HF dir, a .gguf file, an OpenAI-compatible
server or Bedrock. Loaded once per process; every method and trainer in a run shares it."""

from pathlib import Path

import dagster as dg
from pydantic import PrivateAttr

from medgraph.llm import ChatModel, load_llm
from medgraph.settings import DEFAULT_LLM


class LlmResource(dg.ConfigurableResource):
    """See `medgraph.llm.load_llm` for the accepted specs; converted checkpoints cache under `home`."""

    spec: str = DEFAULT_LLM
    home: str
    device: str = "auto"
    dtype: str | None = None
    """float32 | bfloat16 | float16 | auto (bf16 where the CPU has native bf16) | int8 (CPU, dynamic
    quantization); default bf16 on CUDA, float32 on the CPU (benchmarks/llm_dtype.py)."""
    max_batch_size: int = 32
    """Rows per forward call of an in-process model: at least the evaluations' lockstep batch (24)."""
    _llm: ChatModel | None = PrivateAttr(default=None)

    def load(self) -> ChatModel:
        if self._llm is None:
            options: dict[str, object] = {}
            if not self.spec.startswith(("openai:", "bedrock:", "llamacpp:")):
                options["max_batch_size"] = self.max_batch_size
            self._llm = load_llm(self.spec, home=Path(self.home), device=self.device, dtype=self.dtype, **options)
        return self._llm
