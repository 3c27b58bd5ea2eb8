"""Every message that crosses a process boundary.

Channels and their decoders (one typed ``Decoder`` per channel, dispatch with ``match``):

    client  -> scheduler   ZMQ    ClientRequest   = Hello | AddRequest | Abort | StatsQuery
                                                  | TokenizerQuery
    scheduler -> client    ZMQ    SchedulerReply  = EngineInfo | RequestError | EngineStats
                                                  | TokenizerFile
    client  -> output      ZMQ    Hello
    output  -> client      ZMQ    OutputReply     = Hello | OutputBatch | RequestError
    scheduler -> output    ring   Announcement    = NewRequest | AbortRequests
    scheduler -> executor  ring   StepPlan
    executor  -> output    ring   StepResult
    output  -> scheduler   ring   Feedback
    launcher <-> stages    pipe   Control         = ModelInfo | StageReady | StageFailed

Wire structs are ``array_like`` (positional, no field names on the wire), ``omit_defaults``
and tagged by class name. Token ids, logprobs and embeddings travel as :class:`Array`, raw
bytes with a dtype and shape, never as Python lists on the hot path.

Validation lives in the types: constraints are checked when a frame is decoded, so a bad
request fails with a message naming the field (``Expected `float` >= 0.0 - at
`$[3][1]```...). ``SamplingParams.validate`` gives the same check before sending. A malformed
frame raises ``msgspec.DecodeError`` or ``msgspec.ValidationError``, nothing else.

Every size a client controls is bounded here (stop strings, stop token ids, ``n``, ids), so
that no frame a stage derives from a request can outgrow the rings (see ``limits.py``).
"""

from __future__ import annotations

import functools
import math
import operator
import re
from typing import Annotated, Any, Literal, TypeVar

import msgspec
import msgspec.inspect
import numpy as np
from msgspec import Meta

_WIRE = {"array_like": True, "omit_defaults": True, "tag": True, "gc": False}

PROTOCOL_VERSION = 5
T = TypeVar("T", list[int], np.ndarray)

# What one request may ask for (checked when a frame is decoded, naming the field).
MAX_STOP_STRINGS = 64
MAX_STOP_STRING_CHARS = 4096
MAX_STOP_TOTAL_CHARS = 16384  # the stop matcher's set-up is linear in this (~2 us a char)
MAX_STOP_TOKEN_IDS = 1024
MAX_LOGIT_BIAS = 1024  # token ids one request may bias
MAX_LOGPROBS = 20
PROMPT_TAIL_TOKENS = 5  # prompt tokens an output's detokenizer starts from (vLLM's offset)
# Continuations of one beam returned per beam step: (1 + the tokens that end a beam, at
# least 2) x the width, as transformers weighs them (so that ``width`` remain once those
# ending the beam are set aside).
MAX_BEAM_CANDIDATES = 64
GONE_CLIENTS_PER_FEEDBACK = 64  # client ids (ZMQ routing ids: at most 255 bytes each)
MAX_N = 64
INT32_MAX = 2**31 - 1
# The executor divides float32 logits by the temperature and the repetition penalty: past
# these bounds a logit overflows to inf (or the divisor to inf or 0), and the draw to NaN.
# A temperature under GREEDY_TEMPERATURE samples greedily, as in vLLM.
MAX_TEMPERATURE = 1e6
MAX_REPETITION_PENALTY = 1e6
GREEDY_TEMPERATURE = 1e-5

Dtype = Literal["int32", "int64", "float16", "float32", "bool"]
_ITEMSIZE = {"int32": 4, "int64": 8, "float16": 2, "float32": 4, "bool": 1}
NonNegInt = Annotated[int, Meta(ge=0)]
PosInt = Annotated[int, Meta(ge=1)]
Int32 = Annotated[int, Meta(ge=0, le=INT32_MAX)]
MAX_REQUEST_ID = 256  # characters of a caller's request id
# On the wire, a client's number for the submission follows the caller's id ("#12").
Id = Annotated[str, Meta(min_length=1, max_length=MAX_REQUEST_ID + 24)]
FinishReason = Literal["stop", "length", "abort", "error"]
Pooling = Literal["last", "mean", "cls"]


class Array(msgspec.Struct, array_like=True, gc=False, frozen=True):
    """A numpy array as raw little-endian bytes with its dtype and shape."""

    dtype: Dtype
    shape: tuple[NonNegInt, ...]
    data: bytes

    def __post_init__(self) -> None:
        if len(self.data) != math.prod(self.shape) * _ITEMSIZE[self.dtype]:
            raise ValueError(f"Array data is {len(self.data)} bytes, shape {self.shape} needs more")

    @classmethod
    def of(cls, values: np.ndarray | list[int] | list[float], dtype: Dtype = "int32") -> Array:
        arr = np.ascontiguousarray(values, dtype=dtype)
        return cls(dtype, arr.shape, arr.tobytes())

    def numpy(self) -> np.ndarray:
        """A read-only view of the bytes (no copy)."""
        return np.frombuffer(self.data, dtype=self.dtype).reshape(self.shape)

    def __len__(self) -> int:
        return self.shape[0] if self.shape else 1


EMPTY_IDS = Array("int32", (0,), b"")


# -- request parameters ------------------------------------------------------------------


MAX_GRAMMAR_CHARS = 256 * 1024  # a schema, regex or grammar's text
MAX_CHOICES = 1024


class StructuredOutputs(msgspec.Struct, omit_defaults=True, gc=False, forbid_unknown_fields=True):
    """The text a request must generate (vLLM's ``StructuredOutputsParams``), exactly one of:
    ``json`` a JSON schema (as JSON text), ``json_object`` any JSON object, ``regex`` a
    regular expression, ``choice`` one of these strings, ``grammar`` a Lark grammar (a GBNF
    one, with ``::=``, is converted). ``mpengine.structured`` checks and compiles them."""

    json: Annotated[str, Meta(max_length=MAX_GRAMMAR_CHARS)] | None = None
    json_object: bool = False
    regex: Annotated[str, Meta(max_length=MAX_GRAMMAR_CHARS)] | None = None
    choice: (
        Annotated[
            list[Annotated[str, Meta(max_length=MAX_STOP_STRING_CHARS)]],
            Meta(min_length=1, max_length=MAX_CHOICES),
        ]
        | None
    ) = None
    grammar: Annotated[str, Meta(max_length=MAX_GRAMMAR_CHARS)] | None = None

    def __post_init__(self) -> None:
        given = self._given()
        if len(given) != 1:
            raise ValueError(
                "structured outputs take exactly one of json, json_object, regex, choice and "
                f"grammar; got {', '.join(given) or 'none'}"
            )

    @property
    def kind(self) -> str:
        return self._given()[0]

    def _given(self) -> list[str]:
        return [name for name in STRUCTURED_KINDS if getattr(self, name) not in (None, False)]


STRUCTURED_KINDS = ("json", "json_object", "regex", "choice", "grammar")


class SamplingParams(msgspec.Struct, omit_defaults=True, gc=False, forbid_unknown_fields=True):
    """How to sample one request (the fields and meanings of vLLM's ``SamplingParams``).

    ``temperature == 0`` is greedy (any below 1e-5 becomes 0). ``top_k == 0`` disables
    top-k; ``top_p == 1`` and ``min_p == 0`` disable those. ``seed`` makes a request's samples
    reproducible whatever else shares its batches. ``logprobs=N`` returns the N most likely
    tokens at each step (plus the sampled one); ``prompt_logprobs=N`` does the same for
    prompt positions.
    """

    max_tokens: Annotated[int, Meta(ge=1, le=INT32_MAX)] = 16
    temperature: Annotated[float, Meta(ge=0.0, le=MAX_TEMPERATURE)] = 1.0
    top_p: Annotated[float, Meta(gt=0.0, le=1.0)] = 1.0
    top_k: Int32 = 0
    min_p: Annotated[float, Meta(ge=0.0, le=1.0)] = 0.0
    seed: Annotated[int, Meta(ge=-(2**63), le=2**63 - 1)] | None = None
    n: Annotated[int, Meta(ge=1, le=MAX_N)] = 1
    # Generate best_of samples, return the n with the highest cumulative logprob.
    best_of: Annotated[int, Meta(ge=1, le=MAX_N)] | None = None
    repetition_penalty: Annotated[
        float, Meta(ge=1.0 / MAX_REPETITION_PENALTY, le=MAX_REPETITION_PENALTY)
    ] = 1.0
    presence_penalty: Annotated[float, Meta(ge=-2.0, le=2.0)] = 0.0
    frequency_penalty: Annotated[float, Meta(ge=-2.0, le=2.0)] = 0.0
    stop: Annotated[
        list[Annotated[str, Meta(min_length=1, max_length=MAX_STOP_STRING_CHARS)]],
        Meta(max_length=MAX_STOP_STRINGS),
    ] = []
    stop_token_ids: Annotated[list[Int32], Meta(max_length=MAX_STOP_TOKEN_IDS)] = []
    ignore_eos: bool = False
    min_tokens: Int32 = 0
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    logprobs: Annotated[int, Meta(ge=0, le=MAX_LOGPROBS)] | None = None
    prompt_logprobs: Annotated[int, Meta(ge=0, le=MAX_LOGPROBS)] | None = None
    # Keep only the last K prompt tokens (vLLM's left truncation); -1: as many as leave room
    # for one generated token.
    truncate_prompt_tokens: Annotated[int, Meta(ge=-1, le=INT32_MAX)] | None = None
    # Added to the token's logit before penalties and sampling (OpenAI's range); logprobs
    # stay those of the model.
    logit_bias: (
        Annotated[
            dict[Int32, Annotated[float, Meta(ge=-100.0, le=100.0)]],
            Meta(max_length=MAX_LOGIT_BIAS),
        ]
        | None
    ) = None
    # Beam search (transformers' ``generate(num_beams=beam_width, do_sample=False, ...)``):
    # the n best of beam_width beams; deterministic, so the sampling knobs do not apply.
    use_beam_search: bool = False
    beam_width: Annotated[int, Meta(ge=1, le=MAX_N)] | None = None
    length_penalty: float = 1.0
    early_stopping: bool | Literal["never"] = False
    # The format the output must follow (a grammar masks the tokens that would leave it).
    structured_outputs: StructuredOutputs | None = None

    def __post_init__(self) -> None:
        # vLLM's spellings: one stop string, top_k=-1 for "off", max_tokens=None for "as
        # many as fit" (the scheduler caps it at the context).
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.top_k == -1:
            self.top_k = 0
        if self.max_tokens is None:
            self.max_tokens = INT32_MAX
        _check_numbers(self, _SAMPLING_INTS, _SAMPLING_FLOATS)
        if not all(_is_int32(t) for t in self.stop_token_ids):
            raise ValueError("stop_token_ids: token ids must be integers within int32")
        if self.logit_bias is not None:
            if not all(_is_int32(t) for t in self.logit_bias):
                raise ValueError("logit_bias: token ids must be integers within int32")
            values = self.logit_bias.values()
            if not all(isinstance(v, int | float) and math.isfinite(v) for v in values):
                raise ValueError("logit_bias: biases must be finite numbers")
        # (max_tokens < 1 is msgspec's to name, on validate)
        if self.truncate_prompt_tokens == 0:
            raise ValueError("truncate_prompt_tokens must be -1 (all that fit) or >= 1")
        if 1 <= self.max_tokens < self.min_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) > max_tokens ({self.max_tokens})")
        if self.best_of is not None and self.best_of < self.n:
            raise ValueError(f"best_of ({self.best_of}) must be at least n ({self.n})")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")
        if any(lone_surrogate(s) for s in self.stop if isinstance(s, str)):
            raise ValueError("stop: a stop string holds a lone UTF-16 surrogate")
        total = sum(map(len, self.stop))
        if total > MAX_STOP_TOTAL_CHARS:
            raise ValueError(
                f"stop: the stop strings have {total} characters in all; at most "
                f"{MAX_STOP_TOTAL_CHARS}"
            )
        for name in ("temperature", "repetition_penalty", "length_penalty"):
            if not math.isfinite(getattr(self, name)):
                raise ValueError(f"{name} must be finite")
        if 0.0 < self.temperature < GREEDY_TEMPERATURE:
            self.temperature = 0.0
        if self.structured_outputs is not None and (self.ignore_eos or self.min_tokens):
            # Once the grammar is complete only EOS may follow, which these would forbid.
            name = "ignore_eos" if self.ignore_eos else "min_tokens"
            raise ValueError(f"{name} cannot be combined with structured outputs")
        if self.use_beam_search:
            width = self.beam_width or self.n
            if self.n > width:
                raise ValueError(f"n ({self.n}) must be at most beam_width ({width})")
            unsupported = {
                "best_of": self.best_of is not None,
                "stop": bool(self.stop),
                "min_tokens": self.min_tokens > 0,
                "logprobs": self.logprobs is not None,
                "prompt_logprobs": self.prompt_logprobs is not None,
                "penalties": self.has_penalties,
                "logit_bias": bool(self.logit_bias),
                "structured_outputs": self.structured_outputs is not None,
            }
            named = [name for name, used in unsupported.items() if used]
            if named:
                raise ValueError(f"{named[0]}: beam search does not support {', '.join(named)}")

    @property
    def num_samples(self) -> int:
        """Sequences the request runs: its beams, else ``best_of`` when given, else ``n``."""
        if self.use_beam_search:
            return self.beam_width or self.n
        return self.best_of or self.n

    @property
    def ranks_samples(self) -> bool:
        """Whether only the best ``n`` of more samples are returned (they cannot stream)."""
        return self.num_samples > self.n and not self.use_beam_search

    @property
    def streams(self) -> bool:
        """Whether outputs can be streamed: not when ranked or searched (the results are
        known only at the end)."""
        return not self.ranks_samples and not self.use_beam_search

    def beam_candidates(self, num_eos: int) -> int:
        """Continuations kept per beam step (transformers': enough that ``beam_width``
        remain once those ending in EOS are set aside)."""
        return max(2, 1 + num_eos) * self.num_samples

    def for_executor(self) -> SamplingParams:
        """The parameters the executor needs: the same without stop strings (those are the
        output processor's; they can be most of a request's bytes), and with the sampled
        token's logprob when samples are ranked by it."""
        changes: dict = {"stop": []} if self.stop else {}
        if self.ranks_samples and self.logprobs is None:
            changes["logprobs"] = 0
        return msgspec.structs.replace(self, **changes) if changes else self

    def for_beam_executor(self) -> SamplingParams:
        """A beam's executor parameters: greedy (its top continuations come back as
        logprobs, ``RequestParams.beam_candidates`` of them; the output processor selects
        among them)."""
        return SamplingParams(max_tokens=self.max_tokens, temperature=0.0)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def truncated(self, prompt: T, max_model_len: int) -> T:
        """``prompt`` (a list or array of token ids) as ``truncate_prompt_tokens`` keeps it:
        its last K tokens (-1: the last ``max_model_len - 1``)."""
        limit = self.truncate_prompt_tokens
        if limit is None:
            return prompt
        if limit == -1:
            limit = max(max_model_len - 1, 1)
        return prompt[-limit:] if len(prompt) > limit else prompt

    @property
    def has_penalties(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )

    def validate(self) -> SamplingParams:
        """Check every constraint now (the constructor checks the numbers; msgspec checks
        the rest, such as the stop strings' lengths, on decode)."""
        return _revalidate(self)


class PoolingParams(msgspec.Struct, omit_defaults=True, gc=False, forbid_unknown_fields=True):
    """How to turn a prompt's hidden states into one embedding (vLLM's ``PoolingParams``).

    ``None`` means the model's default (``pooling`` and ``normalize`` as its
    sentence-transformers configuration says). ``dimensions`` keeps the first N values
    (Matryoshka), normalised again when the embedding is normalised.
    ``truncate_prompt_tokens=K`` keeps the first K tokens of a longer prompt (text is
    truncated by the tokenizer, special tokens kept); ``-1``, or more than the model takes,
    means ``max_model_len``. Without it a prompt longer than the model takes is an error.
    """

    pooling: Pooling | None = None
    normalize: bool | None = None
    dimensions: Annotated[int, Meta(ge=1, le=INT32_MAX)] | None = None
    truncate_prompt_tokens: Annotated[int, Meta(ge=-1, le=INT32_MAX)] | None = None

    def __post_init__(self) -> None:
        _check_numbers(self, ("dimensions", "truncate_prompt_tokens"), ())
        if self.truncate_prompt_tokens == 0:
            raise ValueError("truncate_prompt_tokens must be -1 (max_model_len) or >= 1")

    def validate(self) -> PoolingParams:
        return _revalidate(self)


_SAMPLING_INTS = (
    "max_tokens",
    "truncate_prompt_tokens",
    "top_k",
    "seed",
    "n",
    "best_of",
    "min_tokens",
    "logprobs",
    "prompt_logprobs",
    "beam_width",
)
_SAMPLING_FLOATS = (
    "temperature",
    "top_p",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "length_penalty",
)


def _check_numbers(params: msgspec.Struct, ints: tuple[str, ...], floats: tuple[str, ...]) -> None:
    """Numeric fields hold numbers (or None) within their annotated ranges, checked when the
    parameters are made: msgspec checks the ranges only when it decodes, so a caller's
    ``SamplingParams(temperature=-1)`` failed later, at the request, in msgspec's words. A
    constructor given ``temperature="0.5"`` says so, not fail comparing a str; integers
    beyond 64 bits, which msgpack cannot carry, are refused."""
    bounds = _bounds(type(params))
    for name in ints + floats:
        value = getattr(params, name)
        allowed = (int,) if name in ints else (int, float)
        if value is None:
            continue
        if not isinstance(value, allowed) or isinstance(value, bool):
            kind = "an integer" if name in ints else "a number"
            raise ValueError(f"{name} ({value!r}) must be {kind}, not {type(value).__name__}")
        if name in ints and not -(2**63) <= value < 2**63:
            raise ValueError(f"{name} ({value}) is outside the 64-bit integer range")
        for op, bound, holds in zip(_OPS, bounds.get(name, ()), _HOLDS, strict=False):
            if bound is not None and not holds(value, bound):
                raise ValueError(f"{name} must be {op} {bound}, got {value}")


_OPS = (">=", ">", "<=", "<")
_HOLDS = (operator.ge, operator.gt, operator.le, operator.lt)


@functools.cache
def _bounds(cls: type) -> dict[str, tuple[float | None, ...]]:
    """Each numeric field's range (ge, gt, le, lt), from its annotation."""
    bounds = {}
    for field in msgspec.inspect.type_info(cls).fields:
        kinds = (
            field.type.types if isinstance(field.type, msgspec.inspect.UnionType) else [field.type]
        )
        for kind in kinds:
            if isinstance(kind, msgspec.inspect.IntType | msgspec.inspect.FloatType):
                bounds[field.name] = (kind.ge, kind.gt, kind.le, kind.lt)
    return bounds


def lone_surrogate(text: str) -> bool:
    """Whether ``text`` holds a lone UTF-16 surrogate: JSON can escape one (``"\\ud800"``) and
    Python decodes it, but it is not Unicode text (it has no UTF-8 form)."""
    if text.isascii():
        return False
    try:
        text.encode()
    except UnicodeEncodeError:
        return True
    return False


def _is_int32(value: object) -> bool:
    in_range = isinstance(value, int) and -INT32_MAX - 1 <= value <= INT32_MAX
    return in_range and not isinstance(value, bool)


def _revalidate(params: msgspec.Struct) -> Any:
    """``params`` through msgpack and back: msgspec checks every constraint on decode."""
    return msgspec.msgpack.decode(msgspec.msgpack.encode(params), type=type(params))


class PoolingInfo(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """What a model can pool: its default pooling and normalisation, the embedding size,
    and whether it is an encoder (bidirectional attention, whole prompts, no KV cache)."""

    pooling: Pooling
    normalize: bool
    hidden_size: int
    is_encoder: bool = False


# -- client <-> scheduler ----------------------------------------------------------------


class Hello(msgspec.Struct, **_WIRE):
    """First message of a client on each of its sockets; the engine answers it."""

    client_id: Id
    protocol_version: int = PROTOCOL_VERSION


class AddRequest(msgspec.Struct, **_WIRE):
    request_id: Id
    prompt_token_ids: Array
    sampling: SamplingParams | None = None
    pooling: PoolingParams | None = None
    arrival_time: float = 0.0
    priority: Annotated[int, Meta(ge=-INT32_MAX - 1, le=INT32_MAX)] = 0  # lower first
    # Part of a batch call whose earlier requests were admitted and finished (a client sends
    # a batch's prompts in windows): a draining engine still admits it, the call being
    # admitted work.
    continues: bool = False
    # Whose share of the engine it uses, among this client's (see ``scheduler/waiting.py``):
    # "" for the client itself; the HTTP server names each HTTP request (or its ``user``).
    tenant: Annotated[str, Meta(max_length=MAX_REQUEST_ID + 24)] = ""

    def __post_init__(self) -> None:
        if (self.sampling is None) == (self.pooling is None):
            raise ValueError("exactly one of sampling and pooling must be given")
        if self.prompt_token_ids.dtype != "int32" or len(self.prompt_token_ids.shape) != 1:
            raise ValueError("prompt_token_ids must be a 1-D int32 array")


class RequestHeader(
    msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag="AddRequest"
):
    """The leading field of an ``AddRequest``: lets the scheduler name a request whose
    frame failed validation in its reply (array-like decoding ignores trailing fields)."""

    request_id: str


class Abort(msgspec.Struct, **_WIRE):
    """Abort some of this client's requests (ids are scoped to the client)."""

    request_ids: list[str]


class TokenizerQuery(msgspec.Struct, **_WIRE):
    """Ask for the engine's ``tokenizer.json`` (remote clients tokenize text with it)."""

    query_id: int


# The tokenizer files a chat template needs (the template, the special tokens it reads),
# those the model has of them travelling in ``TokenizerFile.chat_files``.
CHAT_TEMPLATE_FILES = ("tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")


class TokenizerFile(msgspec.Struct, **_WIRE):
    """The engine's ``tokenizer.json`` (``data``, empty when it has none) and, by name, its
    files of ``CHAT_TEMPLATE_FILES`` (an engine that predates them sends none)."""

    query_id: int
    data: bytes
    chat_files: dict[str, bytes] = {}


class EngineInfo(msgspec.Struct, **_WIRE):
    """The start-up handshake: what a client needs to know about the engine."""

    engine_id: str
    model: str
    tokenizer: str
    vocab_size: int
    max_model_len: int
    block_size: int
    num_blocks: int
    max_num_seqs: int
    max_num_batched_tokens: int
    eos_token_ids: list[int]
    runtime: str
    async_depth: int
    pooling: PoolingInfo | None = None  # None: the model cannot embed
    can_generate: bool = True
    request_address: str = ""
    output_address: str = ""
    max_request_bytes: int = 0
    version: str = ""
    protocol_version: int = PROTOCOL_VERSION
    # The admission queue's bounds (0: unknown); batch calls stay within them.
    max_waiting_requests: int = 0
    max_waiting_tokens: int = 0
    # The model's defaults for the sampling parameters a request leaves out, by field name
    # (``SamplingParams`` fields: temperature, top_p, top_k, min_p, repetition_penalty,
    # max_tokens); see ``default_sampling``.
    sampling_defaults: dict[str, int | float] = {}

    def default_sampling(self, **fields: Any) -> SamplingParams:
        """``SamplingParams(**fields)`` with the model's defaults for the fields left out."""
        return SamplingParams(**{**self.sampling_defaults, **fields})

    @property
    def is_embedding(self) -> bool:
        return self.pooling is not None


class RequestError(msgspec.Struct, **_WIRE):
    """A request was rejected; the engine keeps serving the others."""

    request_id: str
    message: str
    kind: Literal["invalid", "too_large", "unknown", "overloaded", "unauthorized", "internal"] = (
        "invalid"
    )


class StatsQuery(msgspec.Struct, **_WIRE):
    query_id: int


class StageTimes(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """One stage's running totals since it started (seconds; ``steps`` is a count).

    ``wall`` is the time the stage had work: busy, or waiting on a peer. ``idle`` (nothing
    to do at all) is not part of it. ``phases`` splits the busy time (``busy`` is their sum),
    ``waits`` names what the stage waited on: a ring, the lockstep counter (see
    ``runtime/timing.py``).
    """

    steps: int = 0
    wall: float = 0.0
    busy: float = 0.0
    idle: float = 0.0
    phases: dict[str, float] = {}
    waits: dict[str, float] = {}


class EngineStats(msgspec.Struct, **_WIRE):
    """The scheduler's counters and queue sizes (``mpengine top``, tests, metrics)."""

    query_id: int
    step: int
    done: int
    num_waiting: int
    num_running: int
    num_preempted: int
    num_free_blocks: int
    num_blocks: int
    admitted: int
    finished: int
    aborted: int
    preemptions: int
    forked_blocks: int
    # Each stage's time by phase and wait, as of the latest step that reached the scheduler.
    stages: dict[str, StageTimes] = {}
    # Prefix cache: prompt tokens looked up, and found computed (vLLM counts tokens too).
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_cached_blocks: int = 0
    # Tokens sampled and accepted (generation), and tokens computed (prompts and decodes).
    generated_tokens: int = 0
    computed_tokens: int = 0
    # Swap preemption: sequences whose KV blocks are in host memory, and blocks moved.
    num_swapped: int = 0
    swapped_out_blocks: int = 0
    swapped_in_blocks: int = 0
    # Requests queued, and refused at once (invalid, overloaded, draining). Every received
    # request finishes once; ``finished`` also counts those aborted before admission.
    received: int = 0
    rejected: int = 0
    # Steps planned, by tokens computed (vLLM's iteration_tokens_total): counts per bucket
    # of STEP_TOKEN_BUCKETS (at most that many tokens), then those above the last.
    step_tokens: list[int] = []
    # Fair shares: tenants running sequences, and preemptions of a tenant over its share
    # for one under it (also counted in ``preemptions``).
    num_tenants: int = 0
    fair_preemptions: int = 0
    # Restarts of the output processor (its requests re-announced) and of the executor
    # (its sequences recomputed).
    resyncs: int = 0
    executor_restarts: int = 0


# Buckets of the tokens computed in one step (vLLM's, for iteration_tokens_total).
STEP_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)

ClientRequest = Hello | AddRequest | Abort | StatsQuery | TokenizerQuery
SchedulerReply = EngineInfo | RequestError | EngineStats | TokenizerFile


# -- output processor -> client ----------------------------------------------------------


class Logprobs(msgspec.Struct, array_like=True, gc=False):
    """Per position: the chosen token's logprob and the top-N alternatives.

    ``token_ids`` and ``logprobs`` are ``[num_positions]``; ``top_ids`` and ``top_logprobs``
    are ``[num_positions, N]``; ``ranks`` (``[num_positions]``; prompt logprobs only, empty
    elsewhere) is each chosen token's rank in the vocabulary, 1 for the most likely.
    """

    token_ids: Array
    logprobs: Array
    top_ids: Array
    top_logprobs: Array
    ranks: Array = EMPTY_IDS


class OutputDelta(msgspec.Struct, **_WIRE):
    """What one sample of a request produced since the last delta."""

    request_id: str
    index: int  # which of the n samples
    token_ids: Array
    text: str
    # After an output processor's restart (see ``Resync``): how many of the sample's tokens
    # came before these (0 with ``text`` from the start: a replay of everything so far);
    # the client keeps what it lacks. -1: simply the next ones.
    num_prior_tokens: int = -1
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None  # the stop string or token that ended it
    logprobs: Logprobs | None = None
    prompt_logprobs: Logprobs | None = None  # with the first delta of sample 0
    embedding: Array | None = None
    error: str | None = None
    num_prompt_tokens: int = 0
    # Samples ranked by cumulative logprob (best_of > n): each returned sample's score, and
    # on the final delta of index 0 the tokens generated by all best_of samples.
    cumulative_logprob: float | None = None
    num_generated_tokens: int = 0
    # Timings (seconds since the epoch), on the final delta.
    arrival_time: float = 0.0
    scheduled_time: float = 0.0
    first_token_time: float = 0.0
    finished_time: float = 0.0


class OutputBatch(msgspec.Struct, **_WIRE):
    """Every delta for one client from one step, in one message."""

    deltas: list[OutputDelta]


OutputReply = Hello | OutputBatch | RequestError


# -- scheduler -> output processor (announce ring) ---------------------------------------


class NewRequest(msgspec.Struct, **_WIRE):
    """Sent before the first plan that schedules the request."""

    request_id: str
    client_id: str
    seq_ids: list[int]  # one per sample
    num_prompt_tokens: int
    sampling: SamplingParams | None
    pooling: PoolingParams | None
    arrival_time: float
    scheduled_time: float
    prompt_token_ids: Array | None = None  # only when prompt logprobs are asked for
    # The prompt's last tokens (at most PROMPT_TAIL_TOKENS): the context its outputs are
    # decoded in (a SentencePiece output's first "▁word" reads " word" after a prompt).
    prompt_tail: Array | None = None


class AbortRequests(msgspec.Struct, **_WIRE):
    """The scheduler dropped these requests of one client (client abort or error)."""

    client_id: str
    request_ids: list[str]
    reason: FinishReason = "abort"
    message: str = ""


class ResyncRequest(msgspec.Struct, **_WIRE):
    """A request as the scheduler knows it, for a restarted output processor: its
    announcement and each sample's output tokens fed back so far (an ended sample's are
    not needed: it is listed in ``ended``)."""

    request: NewRequest
    outputs: list[Array]
    ended: list[int] = []  # indexes of the samples that have ended
    scores: list[float] = []  # samples ranked at their end: each one's cumulative logprob
    # It starts over (a beam search): results of steps up to this one are for its old
    # state, never visible.
    restarted_after: int = 0


class Resync(msgspec.Struct, **_WIRE):
    """The output processor was restarted: every request announced and not ended, in
    frames of bounded size (``last`` on the final one). Steps up to ``done`` were fed back:
    their results, if still in the result ring, are not processed again."""

    generation: int  # of the output processor it is for
    done: int
    requests: list[ResyncRequest]
    last: bool = True


Announcement = NewRequest | AbortRequests | Resync


# -- scheduler -> executor (plan ring) ---------------------------------------------------


class RequestParams(msgspec.Struct, **_WIRE):
    """What the executor keeps about a request, sent once: in the plan that first starts
    one of its sequences. ``key`` names it in ``SeqStart.request`` until a plan lists it in
    ``released_requests``."""

    key: int
    num_prompt_tokens: int
    sampling: SamplingParams | None  # without stop strings (see ``for_executor``)
    pooling: PoolingParams | None = None
    # The whole prompt, only when prompt logprobs are asked for.
    prompt_token_ids: Array | None = None
    # Beam search: the top continuations each step returns per beam, as logprobs.
    beam_candidates: int = 0


class SeqStart(msgspec.Struct, **_WIRE):
    """A sequence takes a slot: the executor resets the slot's state."""

    slot: int
    seq_id: int
    request: int  # the RequestParams key
    sample_index: int = 0  # which of the request's n samples (derives its seed)
    # Score the prompt (sample 0's first start only, not after a preemption: the prompt
    # logprobs were computed already).
    prompt_logprobs: bool = False


class StepPlan(msgspec.Struct, **_WIRE):
    """What the executor computes in step ``step``.

    Per scheduled sequence ``i`` (arrays of length ``num_seqs``): ``slots[i]`` computes
    ``num_tokens[i]`` tokens at positions ``starts[i] .. starts[i] + num_tokens[i] - 1``.
    ``token_ids`` holds all scheduled tokens flattened in sequence order; ``-1`` means "the
    slot's last sampled token" (a decode step needs no token from the scheduler, which is
    what lets it plan ahead). ``sample[i]`` says whether the chunk ends at the sequence's
    last known token, i.e. whether to sample (partial prefill chunks don't).
    Block tables change by deltas: ``block_tables[slot, index] = block_id``. Swaps are
    copied before the forward, every swap-out before every swap-in (the order the
    scheduler issued them in).
    """

    step: int
    starts: Array
    token_ids: Array
    slots: Array
    num_tokens: Array
    sample: Array
    seq_ids: Array
    new_seqs: list[SeqStart] = []
    block_slots: Array = EMPTY_IDS
    block_indices: Array = EMPTY_IDS
    block_ids: Array = EMPTY_IDS
    new_requests: list[RequestParams] = []  # before the new_seqs that name them
    released_requests: Array = EMPTY_IDS  # int64 keys no later plan names
    # Swap preemption: (device block, host block) pairs to copy out, then (host block,
    # device block) pairs to copy in, flattened.
    swap_out: Array = EMPTY_IDS
    swap_in: Array = EMPTY_IDS
    # The executor generation it is for (0 first, one more at each restart): an executor
    # drops the plans of earlier ones, left in the ring by the scheduler it restarted with.
    generation: int = 0

    @property
    def num_seqs(self) -> int:
        return len(self.slots)


# -- executor -> output processor (result ring) ------------------------------------------


class PromptLogprobs(msgspec.Struct, array_like=True, gc=False):
    """Prompt logprobs for positions ``start .. start + n - 1`` of one sequence."""

    seq_id: int
    start: int
    logprobs: Logprobs


class StepResult(msgspec.Struct, **_WIRE):
    """What step ``step`` produced: one sampled token per sequence that sampled."""

    step: int
    seq_ids: Array  # int64, the sequences that sampled, in plan order
    token_ids: Array  # int32, aligned with seq_ids
    logprobs: Logprobs | None = None  # rows for the seq_ids in logprob_rows
    logprob_rows: Array = EMPTY_IDS  # int32: logprobs row j is for seq_ids[logprob_rows[j]]
    prompt_logprobs: list[PromptLogprobs] = []
    # Pooling requests whose last chunk ran: their embeddings, float32 [len, hidden] (a row
    # asking for fewer ``dimensions`` has zeros past them).
    pooled_seq_ids: Array = EMPTY_IDS  # int64
    embeddings: Array | None = None
    # Sequences that failed in this step (and are finished with ``error``), each with its
    # message; every other scheduled sequence is unaffected.
    failed_seq_ids: Array = EMPTY_IDS  # int64
    errors: list[str] = []
    execute_time: float = 0.0
    # The executor's running totals (``{"executor": ...}``), relayed to the scheduler on the
    # feedback, so that stats need no channel of their own.
    times: dict[str, StageTimes] = {}

    @property
    def error(self) -> str | None:
        """The first failure's message, if any sequence failed."""
        return self.errors[0] if self.errors else None


# -- output processor -> scheduler (feedback ring) ---------------------------------------


class Feedback(msgspec.Struct, **_WIRE):
    """The outcome of step ``step`` after output processing.

    ``seq_ids[i]`` accepted ``token_ids[i]``; ``finished_seq_ids`` ended in this step with
    ``finish_reasons`` (their blocks can be freed once no planned step still touches them).
    """

    step: int
    seq_ids: Array
    token_ids: Array
    finished_seq_ids: list[int] = []
    finish_reasons: list[FinishReason] = []
    # Beam search: after a beam step, beam ``beam_seq_ids[i]`` continues the sequence that
    # ``beam_parents[i]`` was, extended by ``beam_tokens[i]``.
    beam_seq_ids: Array = EMPTY_IDS  # int64
    beam_parents: Array = EMPTY_IDS  # int64
    beam_tokens: Array = EMPTY_IDS  # int32
    # Clients found gone since the last feedback (at most GONE_CLIENTS_PER_FEEDBACK): the
    # scheduler drops the requests it still holds for them, queued ones included.
    gone_clients: list[str] = []
    # The executor's and the output processor's running totals, as of this step.
    times: dict[str, StageTimes] = {}
    # Samples ranked at their end (best_of > n): each accepted token's logprob, which the
    # scheduler sums for a restarted output processor.
    scored_seq_ids: list[int] = []
    scores: list[float] = []


# -- launcher <-> stages (start-up pipes) ------------------------------------------------


class Wiring(msgspec.Struct, **_WIRE):
    """Where a stage finds its peers: socket addresses, ring and counter names."""

    request_address: str
    output_address: str
    plan_ring: str = ""
    result_ring: str = ""
    feedback_ring: str = ""
    announce_ring: str = ""
    lockstep: str = ""
    # The output processor's and the executor's generations: 0 first, then one more at
    # each restart of it (an output processor takes the ``Resync`` of its own generation,
    # an executor the plans of its own).
    output_generation: int = 0
    executor_generation: int = 0
    # Stages were restarted: clients are connecting again (an output processor keeps the
    # deltas of those not back yet for a while).
    clients_returning: bool = False
    # Tensor-parallel ranks: the ring rank 0 broadcasts the plans on, the process group's
    # address (torch.distributed's init_method).
    rank_ring: str = ""
    dist_init: str = ""


class ModelInfo(msgspec.Struct, **_WIRE):
    """What the executor learned loading the model (the KV cache geometry, the model's
    limits and what it can do); the launcher relays it to the other stages."""

    model_path: str
    tokenizer_path: str
    vocab_size: int
    max_model_len: int
    num_blocks: int
    block_size: int
    eos_token_ids: list[int]
    kv_cache_bytes: int = 0
    device: str = "cpu"
    dtype: str = "float32"
    num_threads: int = 1  # the executor's torch threads (at most, when tuned)
    thread_tuning: bool = False  # one thread or num_threads per size of step, timed
    pooling: PoolingInfo | None = None  # None: the model cannot embed
    can_generate: bool = True
    num_host_blocks: int = 0  # swap space, in KV blocks
    # The model's default sampling parameters (its generation_config.json), by field name.
    sampling_defaults: dict[str, int | float] = {}


class StageReady(msgspec.Struct, **_WIRE):
    stage: str
    pid: int
    model: ModelInfo | None = None


class StageFailed(msgspec.Struct, **_WIRE):
    stage: str
    message: str


Control = ModelInfo | StageReady | StageFailed


# -- decoders: one per channel -----------------------------------------------------------


def describe_error(exc: Exception, cls: type[msgspec.Struct]) -> str:
    """Name the field in a validation error of an array-like struct: ``$[3].temperature``
    becomes ``sampling.temperature`` for an ``AddRequest``."""
    msg = str(exc)
    match = re.search(r"`\$\[(\d+)\]", msg)
    if match is None:
        return msg
    index = int(match.group(1)) - 1  # element 0 is the tag
    fields = cls.__struct_fields__
    if not 0 <= index < len(fields):
        return msg
    return msg[: match.start()] + "`" + fields[index] + msg[match.end() :].replace("`$", "`", 1)


encoder = msgspec.msgpack.Encoder()


def client_request_decoder() -> msgspec.msgpack.Decoder:
    return msgspec.msgpack.Decoder(ClientRequest)


def scheduler_reply_decoder() -> msgspec.msgpack.Decoder:
    return msgspec.msgpack.Decoder(SchedulerReply)


def output_reply_decoder() -> msgspec.msgpack.Decoder:
    return msgspec.msgpack.Decoder(OutputReply)


def announcement_decoder() -> msgspec.msgpack.Decoder:
    return msgspec.msgpack.Decoder(Announcement)


def plan_decoder() -> msgspec.msgpack.Decoder:
    return msgspec.msgpack.Decoder(StepPlan)


def result_decoder() -> msgspec.msgpack.Decoder:
    return msgspec.msgpack.Decoder(StepResult)


def feedback_decoder() -> msgspec.msgpack.Decoder:
    return msgspec.msgpack.Decoder(Feedback)


def control_decoder() -> msgspec.msgpack.Decoder:
    return msgspec.msgpack.Decoder(Control)


DECODERS = {
    "control": control_decoder,
    "client_request": client_request_decoder,
    "scheduler_reply": scheduler_reply_decoder,
    "output_reply": output_reply_decoder,
    "announcement": announcement_decoder,
    "plan": plan_decoder,
    "result": result_decoder,
    "feedback": feedback_decoder,
}
