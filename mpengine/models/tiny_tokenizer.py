"""Byte-level BPE tokenizers trained offline on the bundled corpus.

Every tiny model ships its own tokenizer: the special tokens take the first ids, then
the 256 byte symbols, then the learned merges. The corpus mixes English with accented
Latin, CJK and emoji, so some merges cover only part of a multi-byte character; an
incremental detokenizer that decodes token by token meets invalid UTF-8 mid-character.

`tokenizer.json` alone defines the tokenization (pre-tokenizer, post-processor, decoder,
special tokens), so code that uses the `tokenizers` library directly agrees with
`AutoTokenizer`, which additionally reads `tokenizer_config.json` for the named special
tokens and the chat template.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

from tokenizers import (
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
    trainers,
)

CORPUS_DIR = Path(__file__).with_name("corpus")

# The attributes `PreTrainedTokenizerFast` knows as named special tokens.
SPECIAL_TOKEN_ROLES = (
    "bos_token",
    "eos_token",
    "pad_token",
    "unk_token",
    "cls_token",
    "sep_token",
    "mask_token",
)


@dataclass(frozen=True)
class TokenizerSpec:
    """What a tokenizer looks like; two equal specs train byte-identical tokenizers.

    `special_tokens` get ids 0.. in order. `roles` maps a role in SPECIAL_TOKEN_ROLES to
    one of them. `template` and `pair_template` are `TemplateProcessing` templates for
    tokenizers that wrap every input (a BOS, or BERT's [CLS] ... [SEP]); None keeps
    the input as is.
    """

    special_tokens: tuple[str, ...]
    roles: tuple[tuple[str, str], ...]
    chat_template: str | None = None
    template: str | None = None
    pair_template: str | None = None
    vocab_size: int = 2048
    model_max_length: int = 4096
    model_input_names: tuple[str, ...] = ("input_ids", "attention_mask")

    def __post_init__(self) -> None:
        for role, token in self.roles:
            assert role in SPECIAL_TOKEN_ROLES, role
            assert token in self.special_tokens, token
        assert len(set(self.special_tokens)) == len(self.special_tokens)

    def role_id(self, role: str) -> int | None:
        """The id of the special token playing `role`, or None if the spec has none."""
        token = dict(self.roles).get(role)
        return None if token is None else self.special_tokens.index(token)


def corpus_texts() -> list[str]:
    """The training corpus, one string per file, in a fixed (sorted) order."""
    return [p.read_text(encoding="utf-8") for p in sorted(CORPUS_DIR.glob("*.txt"))]


@functools.cache
def corpus_digest() -> str:
    """A hash of the corpus, part of the cache key of every built model."""
    digest = hashlib.sha256()
    for text in corpus_texts():
        digest.update(text.encode("utf-8"))
        digest.update(b"\0")
    return digest.hexdigest()


@functools.cache
def _train(spec: TokenizerSpec) -> str:
    """Train once per spec and process; returns the serialized tokenizer.json."""
    tokenizer = Tokenizer(models.BPE())
    # The GPT-2 split regex without a prefix space: " world" and "world" differ, as in
    # Qwen, Llama 3 and GPT-2.
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=spec.vocab_size,
        min_frequency=2,
        special_tokens=list(spec.special_tokens),
        # All 256 bytes, even those absent from the corpus, so any text can be encoded.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    # Merge order breaks count ties by pair id, so the result does not depend on thread
    # scheduling (checked: equal hashes with 1 and 16 threads). Training serially anyway
    # costs ~0.1 s and leaves nothing to chance; `tokenizers` reads the variable per call.
    saved = os.environ.get("TOKENIZERS_PARALLELISM")
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    try:
        tokenizer.train_from_iterator(corpus_texts(), trainer)
    finally:
        if saved is None:
            del os.environ["TOKENIZERS_PARALLELISM"]
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = saved
    tokenizer.post_processor = _post_processor(spec, tokenizer)
    return tokenizer.to_str(pretty=True)


def _post_processor(spec: TokenizerSpec, tokenizer: Tokenizer) -> processors.PostProcessor:
    if spec.template is None:
        # What GPT-2 and Qwen ship: no tokens added, offsets left untrimmed.
        return processors.ByteLevel(trim_offsets=False)
    # Template pieces are "$A", "$B:1", "[SEP]", "[SEP]:1": the rest are special tokens.
    pieces = f"{spec.template} {spec.pair_template or ''}".split()
    used = sorted({piece.split(":")[0] for piece in pieces if not piece.startswith("$")})
    return processors.TemplateProcessing(
        single=spec.template,
        pair=spec.pair_template,
        special_tokens=[(token, tokenizer.token_to_id(token)) for token in used],
    )


def train_tokenizer(spec: TokenizerSpec) -> Tokenizer:
    """The tokenizer of `spec`, trained on the corpus (once per process and spec)."""
    return Tokenizer.from_str(_train(spec))


def write_tokenizer(spec: TokenizerSpec, out_dir: Path) -> Tokenizer:
    """Train (or reuse) the tokenizer of `spec`, write its files, and return it."""
    tokenizer_json = _train(spec)
    (out_dir / "tokenizer.json").write_text(tokenizer_json, encoding="utf-8")
    config: dict[str, object] = {
        # The generic fast tokenizer: everything it needs is in tokenizer.json.
        "tokenizer_class": "PreTrainedTokenizerFast",
        **dict(spec.roles),
        # Role markers and the like: special tokens without a named role.
        "extra_special_tokens": [
            t for t in spec.special_tokens if t not in dict(spec.roles).values()
        ],
        "model_max_length": spec.model_max_length,
        "model_input_names": list(spec.model_input_names),
        "clean_up_tokenization_spaces": False,
    }
    if spec.chat_template is not None:
        config["chat_template"] = spec.chat_template
    (out_dir / "tokenizer_config.json").write_text(
        json.dumps(config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8"
    )
    return Tokenizer.from_str(tokenizer_json)


# ChatML, as Qwen uses it.
CHATML_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# Llama 3's header markers; the template starts with BOS because chat templates are
# tokenized without the post-processor's special tokens.
LLAMA3_TEMPLATE = (
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'"
    " + message['content'] + '<|eot_id|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    "{%- endif %}"
)

# Zephyr's role markers, each turn closed by EOS.
ZEPHYR_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|' + message['role'] + '|>\\n' + message['content'] + eos_token + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|assistant|>\\n' }}{%- endif %}"
)

QWEN3_TOKENIZER = TokenizerSpec(
    special_tokens=("<|endoftext|>", "<|im_start|>", "<|im_end|>"),
    # As in Qwen3: nothing is prepended, a chat turn ends with <|im_end|>, and
    # <|endoftext|> doubles as BOS and padding.
    roles=(
        ("bos_token", "<|endoftext|>"),
        ("eos_token", "<|im_end|>"),
        ("pad_token", "<|endoftext|>"),
    ),
    chat_template=CHATML_TEMPLATE,
)

LLAMA_TOKENIZER = TokenizerSpec(
    special_tokens=(
        "<|begin_of_text|>",
        "<|eot_id|>",
        "<|start_header_id|>",
        "<|end_header_id|>",
        "<|pad|>",
    ),
    roles=(
        ("bos_token", "<|begin_of_text|>"),
        ("eos_token", "<|eot_id|>"),
        ("pad_token", "<|pad|>"),
    ),
    chat_template=LLAMA3_TEMPLATE,
    template="<|begin_of_text|> $A",
    pair_template="<|begin_of_text|> $A <|begin_of_text|>:1 $B:1",
)

GPT2_TOKENIZER = TokenizerSpec(
    special_tokens=("<|endoftext|>", "<|pad|>", "<|system|>", "<|user|>", "<|assistant|>"),
    # GPT-2's single <|endoftext|> is both BOS and EOS.
    roles=(
        ("bos_token", "<|endoftext|>"),
        ("eos_token", "<|endoftext|>"),
        ("pad_token", "<|pad|>"),
    ),
    chat_template=ZEPHYR_TEMPLATE,
    model_max_length=2048,
)

BERT_TOKENIZER = TokenizerSpec(
    special_tokens=("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"),
    roles=(
        ("pad_token", "[PAD]"),
        ("unk_token", "[UNK]"),
        ("cls_token", "[CLS]"),
        ("sep_token", "[SEP]"),
        ("mask_token", "[MASK]"),
    ),
    template="[CLS] $A [SEP]",
    pair_template="[CLS] $A [SEP] $B:1 [SEP]:1",
    model_max_length=512,
    model_input_names=("input_ids", "token_type_ids", "attention_mask"),
)


@functools.cache
def sentencepiece_tokenizer() -> Tokenizer:
    """A Llama 2 / Mistral style tokenizer: "▁" for spaces, byte-fallback tokens
    ``<0xE6>`` for characters outside the vocabulary, and a context-dependent decoder
    (the leading space of the text is stripped)."""
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    tokenizer.normalizer = normalizers.Sequence(
        [normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")]
    )
    tokenizer.pre_tokenizer = pre_tokenizers.Split("▁", behavior="merged_with_next")
    tokenizer.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    trainer = trainers.BpeTrainer(
        vocab_size=600,
        special_tokens=["<unk>", "<s>", "</s>"],
        limit_alphabet=70,
        show_progress=False,
    )
    tokenizer.train_from_iterator(
        [t for text in corpus_texts() for t in text.splitlines()], trainer
    )
    spec = json.loads(tokenizer.to_str())
    vocab = spec["model"]["vocab"]
    for byte in range(256):
        vocab.setdefault(f"<0x{byte:02X}>", len(vocab))
    return Tokenizer.from_str(json.dumps(spec))
