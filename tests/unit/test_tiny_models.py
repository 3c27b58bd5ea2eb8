"""The tiny model builder: loadable offline, deterministic, and free of greedy near-ties."""

from __future__ import annotations

import statistics
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import huggingface_hub.constants
import pytest
import torch
from tokenizers import Tokenizer
from transformers import (
    AutoModel,
    AutoModelForCausalLM,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from mpengine.models import tiny
from mpengine.models.resolve import resolve_model
from mpengine.models.tiny import KNOWN_MODELS, build, greedy_margins

CAUSAL_ARCHS = {"qwen3": "Qwen3ForCausalLM", "llama": "LlamaForCausalLM", "gpt2": "GPT2LMHeadModel"}
ALL_ARCHS = {**CAUSAL_ARCHS, "bert": "BertModel"}

# Accented Latin, CJK (with a full-width comma), a ZWJ emoji sequence, symbols, code.
TEXT = "Héllo wörld! 你好，世界 🎉👨‍👩‍👧 naïve café — ∑x² ≈ 3.14\n\tdef f(x):  return x  "  # noqa: RUF001
PROMPTS = (
    "The lighthouse keeper",
    "def fibonacci(n):",
    "Bonjour, ça va ?",
    "今天天气很好",
    "1, 2, 3, 4,",
    "🎉 Party",
)
Loaded = dict[str, tuple[PreTrainedModel, PreTrainedTokenizerBase]]

MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi there"},
]


@pytest.fixture(scope="module", autouse=True)
def offline_single_thread() -> Iterator[None]:
    # transformers reads huggingface_hub's constant, which the variable sets only at import.
    # One thread: faster than several on models this small, and kinder to parallel tests.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("HF_HUB_OFFLINE", "1")
        patch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
        yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("first")
    return {arch: build(arch, root / arch) for arch in ALL_ARCHS}


@pytest.fixture(scope="module")
def loaded(built: dict[str, Path]) -> Loaded:
    """Each arch's model (eval mode) and tokenizer, loaded the way a user would."""
    return {
        arch: (
            (AutoModelForCausalLM if arch in CAUSAL_ARCHS else AutoModel).from_pretrained(path),
            AutoTokenizer.from_pretrained(path),
        )
        for arch, path in built.items()
    }


@pytest.mark.parametrize("arch", ALL_ARCHS)
def test_loads_with_auto_classes(arch: str, built: dict[str, Path], loaded: Loaded) -> None:
    model, tokenizer = loaded[arch]
    assert type(model).__name__ == ALL_ARCHS[arch]
    assert not model.training
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert tokenizer.is_fast
    assert model.config.vocab_size >= len(tokenizer)
    assert {"model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= {
        p.name for p in built[arch].iterdir()
    }


@pytest.mark.parametrize("arch", ALL_ARCHS)
def test_tokenizer_round_trips_multibyte_text(
    arch: str, built: dict[str, Path], loaded: Loaded
) -> None:
    _, tokenizer = loaded[arch]
    ids = tokenizer(TEXT, add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(ids) == TEXT
    # Some tokens hold part of a character: decoded alone they are invalid UTF-8.
    assert any("\ufffd" in tokenizer.decode([i]) for i in ids)
    # tokenizer.json alone (what a process without transformers loads) agrees.
    raw = Tokenizer.from_file(str(built[arch] / "tokenizer.json"))
    assert raw.encode(TEXT).ids == tokenizer(TEXT)["input_ids"]
    assert raw.decode(ids) == TEXT


@pytest.mark.parametrize("arch", CAUSAL_ARCHS)
def test_special_token_ids_agree(arch: str, loaded: Loaded) -> None:
    model, tokenizer = loaded[arch]
    for role in ("bos_token_id", "eos_token_id", "pad_token_id"):
        token_id = getattr(tokenizer, role)
        assert token_id is not None
        assert token_id == getattr(model.config, role) == getattr(model.generation_config, role)
        assert token_id in tokenizer.all_special_ids
    # Only Llama prepends BOS, as the originals do.
    first = tokenizer("hello")["input_ids"][0]
    assert (first == tokenizer.bos_token_id) == (arch == "llama")


def test_bert_wraps_and_pads(loaded: Loaded) -> None:
    model, tokenizer = loaded["bert"]
    batch = tokenizer(["a short one", TEXT], padding=True, return_tensors="pt")
    ids = batch["input_ids"]
    assert ids[0, 0] == ids[1, 0] == tokenizer.cls_token_id
    assert ids[1, -1] == tokenizer.sep_token_id
    assert ids[0, -1] == tokenizer.pad_token_id == model.config.pad_token_id
    assert "token_type_ids" in batch
    with torch.no_grad():
        hidden = model(**batch).last_hidden_state
    assert hidden.shape == (2, ids.shape[1], model.config.hidden_size)
    assert not torch.allclose(hidden[0, 1], hidden[1, 1])


@pytest.mark.parametrize("arch", CAUSAL_ARCHS)
def test_chat_template_renders(arch: str, loaded: Loaded) -> None:
    _, tokenizer = loaded[arch]
    text = tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    if arch == "qwen3":
        assert text == (
            "<|im_start|>system\nBe brief.<|im_end|>\n"
            "<|im_start|>user\nHi there<|im_end|>\n"
            "<|im_start|>assistant\n"
        )
    assert "Be brief." in text and "Hi there" in text
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    # Role markers are special tokens: one id each, and dropped by skip_special_tokens.
    markers = [t for t in tokenizer.all_special_tokens if t in text]
    assert len(markers) >= 2
    for marker in markers:
        assert tokenizer.convert_tokens_to_ids(marker) in ids
    assert tokenizer.decode(ids) == text
    assert all(m not in tokenizer.decode(ids, skip_special_tokens=True) for m in markers)


@pytest.mark.parametrize("arch", CAUSAL_ARCHS)
def test_generation_is_deterministic_and_varied(
    arch: str, built: dict[str, Path], loaded: Loaded
) -> None:
    model, tokenizer = loaded[arch]
    prompt = tokenizer(PROMPTS[0], return_tensors="pt")
    kwargs = dict(do_sample=False, max_new_tokens=16, min_new_tokens=16)
    first = model.generate(**prompt, **kwargs)
    again = AutoModelForCausalLM.from_pretrained(built[arch]).generate(**prompt, **kwargs)
    assert torch.equal(first, again)
    new_tokens = first[0, prompt["input_ids"].shape[1] :].tolist()
    assert len(set(new_tokens)) >= 4, new_tokens  # no collapse into one repeated token


@pytest.mark.parametrize("arch", CAUSAL_ARCHS)
def test_logits_are_not_flat(arch: str, loaded: Loaded) -> None:
    """A near-tie (top-2 gap ~1e-6) lets a correct engine differ from HF by float noise."""
    model, tokenizer = loaded[arch]
    gaps: list[float] = []
    for prompt in PROMPTS:
        gaps += greedy_margins(model, tokenizer(prompt)["input_ids"], num_steps=16)[1]
    assert statistics.median(gaps) > 0.05
    assert min(gaps) > 1e-4


def test_builds_are_byte_identical(tmp_path: Path, built: dict[str, Path]) -> None:
    for arch, first in built.items():
        second = build(arch, tmp_path / arch)
        names = sorted(str(p.relative_to(first)) for p in first.rglob("*") if p.is_file())
        assert names == sorted(str(p.relative_to(second)) for p in second.rglob("*") if p.is_file())
        for name in names:
            assert (first / name).read_bytes() == (second / name).read_bytes(), (arch, name)


def test_tokenizer_training_is_deterministic_across_processes(
    tmp_path: Path, built: dict[str, Path]
) -> None:
    # A fresh process has fresh hash seeds and thread pools: the risk for BPE training.
    code = (
        "import sys; from pathlib import Path; from mpengine.models import tiny_tokenizer as t\n"
        "for arch in ('qwen3', 'llama', 'gpt2', 'bert'):\n"
        "    d = Path(sys.argv[1]) / arch; d.mkdir()\n"
        "    t.write_tokenizer(getattr(t, arch.upper() + '_TOKENIZER'), d)\n"
    )
    subprocess.run([sys.executable, "-c", code, str(tmp_path)], check=True, timeout=60)
    for arch, first in built.items():
        for name in ("tokenizer.json", "tokenizer_config.json"):
            assert (tmp_path / arch / name).read_bytes() == (first / name).read_bytes()


def test_small_preset_has_about_25m_parameters() -> None:
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(
            tiny.model_config(tiny.model_spec("qwen3", "small"))
        )
    assert 20e6 < sum(p.numel() for p in model.parameters()) < 30e6


def test_resolve_model_builds_once_into_the_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MPENGINE_CACHE_DIR", str(tmp_path))
    path = Path(resolve_model("tiny-llama"))
    assert path.parent == tmp_path / "models" and path.name.startswith("tiny-llama-")
    assert AutoTokenizer.from_pretrained(path).bos_token == "<|begin_of_text|>"

    def no_build(*args: object, **kwargs: object) -> None:
        raise AssertionError("a cached model was rebuilt")

    monkeypatch.setattr(tiny, "build", no_build)
    assert resolve_model("tiny-llama") == str(path)
    assert resolve_model(str(path)) == str(path)  # a directory passes through
    assert sorted(p.name for p in (tmp_path / "models").iterdir()) == [path.name]  # no temps


def test_unknown_name_lists_known_models() -> None:
    with pytest.raises(ValueError, match="tiny-bert") as error:
        resolve_model("no-such-model")
    assert all(name in str(error.value) for name in KNOWN_MODELS)


def test_the_cache_follows_xdg_unless_told(monkeypatch: pytest.MonkeyPatch) -> None:
    from mpengine.envs import cache_dir

    monkeypatch.delenv("MPENGINE_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", "/xdg")
    assert cache_dir() == Path("/xdg/mpengine")
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/dir")  # ignored, as the spec says
    assert cache_dir() == Path.home() / ".cache" / "mpengine"
    monkeypatch.setenv("MPENGINE_CACHE_DIR", "/mine")
    assert cache_dir() == Path("/mine")
    monkeypatch.delenv("MPENGINE_CACHE_DIR")
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert cache_dir() == Path.home() / ".cache" / "mpengine"


def test_an_unwritable_cache_names_the_variable_to_set(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MPENGINE_CACHE_DIR", "/proc/no-such-dir")
    with pytest.raises(OSError, match="MPENGINE_CACHE_DIR"):
        resolve_model("tiny")


def test_the_shape_models_have_qwen3_0_6b_dimensions() -> None:
    """Built offline with random weights for device benchmarks: the real model's layers and
    its padded vocabulary (the LM head and sampling are a share of a decode step), though
    the built-in tokenizer names fewer tokens."""
    config = tiny.model_config(tiny.model_spec("qwen3", "0.6b-shape"))
    assert (config.num_hidden_layers, config.hidden_size, config.intermediate_size) == (
        28,
        1024,
        3072,
    )
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (
        16,
        8,
        128,
    )
    assert config.vocab_size == 151_936 and config.tie_word_embeddings
    assert tiny.model_config(tiny.model_spec("qwen3", "tiny")).vocab_size == 2048
