"""Models: what a model name means (``resolve``), the built-in ones (``builtin``), the cache
that holds built and converted models (``cache``) and GGUF files (``gguf``).

Nothing here imports torch at import time: the launcher checks a model name before any
stage starts (``resolve.check_model``); building or converting happens in the executor.
"""
