"""Test support: a fake executor (``fake``), engine helpers for tests (``engine``), benchmark
helpers (``bench``) and reference embeddings (``embedding_reference``). The tiny built-in
models themselves are product code: ``mpengine.models.tiny``."""
