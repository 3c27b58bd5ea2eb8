"""Structured outputs: the generated text follows a JSON schema, a regular expression, a
choice of strings or a grammar (vLLM's ``structured_outputs``; OpenAI's ``response_format``).

``grammars`` turns a request's :class:`~mpengine.protocol.StructuredOutputs` into the
grammar library's text and checks it without a tokenizer (the scheduler's admission, so a
bad schema is the request's error, whichever way it came). ``matchers`` runs in the
executor: one matcher per sequence, which masks the tokens that would leave the grammar
before each draw. The library is llguidance (see ``docs/architecture.md`` for the choice
and its measurements).
"""
