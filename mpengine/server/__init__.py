"""``mpengine serve``'s HTTP front end: an OpenAI-compatible API over the IPC client library.

One module per concern: ``options`` (the command's flags, importable without FastAPI),
``run`` (start, signals, drain, systemd), ``app`` (routes, API key, body limit), ``schemas``
(request and response shapes), ``completions`` and ``chat`` (the two generation endpoints),
``embeddings`` (``/v1/embeddings``),
``generation`` (engine requests on behalf of HTTP requests), ``sse`` (streaming), ``logprobs``,
``text`` (tokenizer and chat template), ``errors`` (OpenAI's error shape), ``health`` (what
``/health`` and the watchdog say), ``state`` (what the endpoints share).
"""
