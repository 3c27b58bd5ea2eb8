"""Test support: deterministic tiny models built offline (see `mpengine.testing.tiny`).

`build`, `built_model` and `KNOWN_MODELS` are re-exported lazily, so that importing a
torch-free module of this package (`tiny_tokenizer`, used by the output processor's tests)
does not pull in torch and transformers.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mpengine.testing.tiny import KNOWN_MODELS, build, built_model

__all__ = ["KNOWN_MODELS", "build", "built_model"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from mpengine.testing import tiny

        return getattr(tiny, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
