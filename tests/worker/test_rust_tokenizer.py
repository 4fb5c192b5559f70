"""worker/loading/tokenizer.py: the engine's Rust tokenizer equals transformers' AutoTokenizer wherever it is used (SmolLM2's
byte-level BPE and the tiny word-level tokenizer), and anything it cannot prove equal goes to transformers."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest

from infer.protocol.prompt_limits import max_token_bytes
from infer.worker.loading.model_files import eos_token_ids, load_tokenizer
from infer.worker.loading.tokenizer import (
    GENERIC_CLASSES,
    MODEL_TYPES,
    RustTokenizer,
    engine_tokenizer,
    rust_tokenizer_refusal,
    transformers_tokenizer,
)

PIECES = (
    "Hello",
    " world",
    "  ",
    "\n\n",
    "\t",
    "   x",
    "你好",
    "世界",
    "😀",
    "🎉🎉",
    "é",
    "naïve",
    "日本語",
    "<|im_start|>",
    "<|im_end|>",
    "<|endoftext|>",
    "<s>",
    "</s>",
    "<|user|>",
    "<unk>",
    "<|im_start",
    "the",
    " cat",
    "sat",
    "42",
    "3.14",
    "!?",
    "\u200b",
    "\r\n",
    "Ω≈ç√",
    "ﬁ",
    "a" * 40,
)


def _texts(n: int, seed: int) -> list[str]:
    """`n` strings of 1-8 random pieces (multi-byte, emoji, whitespace runs, special-token text), plus edge cases."""
    rng = random.Random(seed)
    texts = ["", " ", "a", " leading space", "trailing space ", "<|im_start|>user\nhi<|im_end|>\n"]
    texts += ["".join(rng.choice(PIECES) for _ in range(rng.randint(1, 8))) for _ in range(n)]
    return texts


@pytest.fixture(scope="module")
def tokenizer_dirs(smollm2_dir: Path, tiny_words_model: Path) -> dict[str, Path]:
    return {"smollm2": smollm2_dir, "words": tiny_words_model}


@pytest.mark.parametrize("name", ["smollm2", "words"])
def test_rust_tokenizer_equals_autotokenizer(tokenizer_dirs: dict[str, Path], name: str) -> None:
    path = tokenizer_dirs[name]
    assert rust_tokenizer_refusal(path) is None
    ours, theirs = engine_tokenizer(path), load_tokenizer(path)
    assert isinstance(ours, RustTokenizer)
    assert ours.all_special_ids == theirs.all_special_ids
    assert ours.eos_token_id == theirs.eos_token_id and len(ours) == len(theirs)
    assert eos_token_ids(path, ours) == eos_token_ids(path, theirs)
    assert max_token_bytes(ours) == max_token_bytes(theirs)
    for text in _texts(300, seed=len(name)):
        for special in (True, False):
            want = theirs(text, add_special_tokens=special)["input_ids"]
            assert ours.encode(text, add_special_tokens=special) == want, (text, special)
            assert ours(text, add_special_tokens=special)["input_ids"] == want
    vocab = list(range(len(theirs)))
    assert [ours.convert_ids_to_tokens(i) for i in vocab] == [theirs.convert_ids_to_tokens(i) for i in vocab]
    assert ours.convert_ids_to_tokens(vocab, skip_special_tokens=True) == theirs.convert_ids_to_tokens(
        vocab, skip_special_tokens=True
    )
    rng = random.Random(7)
    specials, known = theirs.all_special_ids, [i for i in vocab if theirs.convert_ids_to_tokens(i) is not None]
    for _ in range(300):
        ids = [rng.choice(specials if rng.random() < 0.1 else known) for _ in range(rng.randint(1, 12))]
        tokens = theirs.convert_ids_to_tokens(ids)
        assert ours.convert_tokens_to_string(tokens) == theirs.convert_tokens_to_string(tokens), ids
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == theirs.decode(ids, skip_special_tokens=skip), ids


def test_rust_tokenizer_loads_transformers_once(smollm2_dir: Path) -> None:
    ours = engine_tokenizer(smollm2_dir)
    first = transformers_tokenizer(ours)
    assert first is transformers_tokenizer(ours) and type(first) is type(load_tokenizer(smollm2_dir))
    plain = load_tokenizer(smollm2_dir)
    assert transformers_tokenizer(plain) is plain


def _copy(src: Path, dest: Path, **changes: object) -> Path:
    """The tokenizer files of `src` in `dest`, with tokenizer_config.json's keys changed (None: removed)."""
    dest.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(src / name, dest / name)
    config = json.loads((dest / "tokenizer_config.json").read_text())
    config.update(changes)
    config = {key: value for key, value in config.items() if value is not None}
    (dest / "tokenizer_config.json").write_text(json.dumps(config))
    return dest


@pytest.mark.parametrize(
    ("changes", "reason"),
    [
        ({"tokenizer_class": "GPT2Tokenizer"}, "not transformers' generic backend"),
        ({"tokenizer_class": None}, "not transformers' generic backend"),
        ({"auto_map": {"AutoTokenizer": ["x.Tok", None]}}, "may change the tokenizer"),
        ({"split_special_tokens": True}, "split_special_tokens"),
        ({"eos_token": "<new_eos>"}, "not plain special tokens"),
        ({"extra_special_tokens": {"image_token": "<|im_start|>"}}, "one plain list"),
        ({"added_tokens_decoder": {"60000": {"content": "<x>", "special": True}}}, "added_tokens_decoder"),
        ({"fix_mistral_regex": True}, "may change the tokenizer"),
    ],
)
def test_allowlist_falls_back_to_transformers(smollm2_dir: Path, tmp_path: Path, changes: dict, reason: str) -> None:
    path = _copy(smollm2_dir, tmp_path / "tok", **changes)
    refusal = rust_tokenizer_refusal(path)
    assert refusal is not None and reason in refusal
    if "auto_map" not in changes:  # (the checkpoint's own code is not there to run)
        assert not isinstance(engine_tokenizer(path), RustTokenizer)


def test_allowlist_checks_config_and_files(smollm2_dir: Path, tmp_path: Path) -> None:
    path = _copy(smollm2_dir, tmp_path / "tok")
    assert rust_tokenizer_refusal(path) is None
    (path / "special_tokens_map.json").write_text("{}")
    assert "special_tokens_map.json" in (rust_tokenizer_refusal(path) or "")
    (path / "special_tokens_map.json").unlink()
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "auto_map": {"AutoConfig": "x.Config"}}))
    assert "auto_map" in (rust_tokenizer_refusal(path) or "")
    (path / "config.json").write_text(json.dumps({**config, "model_type": "mistral"}))
    assert "model type" in (rust_tokenizer_refusal(path) or "")
    spec = json.loads((path / "tokenizer.json").read_text())
    (path / "config.json").write_text(json.dumps(config))
    (path / "tokenizer.json").write_text(json.dumps({**spec, "truncation": {"max_length": 8}}))
    assert "truncates" in (rust_tokenizer_refusal(path) or "")


def test_model_types_keep_the_generic_class() -> None:
    """AutoTokenizer keeps a tokenizer_config.json's generic class for MODEL_TYPES (its exceptions, read from
    transformers itself: a version that adds one of them fails here)."""
    from transformers.models.auto import tokenization_auto as auto

    for model_type in MODEL_TYPES:
        assert model_type not in auto.MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS
        assert (auto.TOKENIZER_MAPPING_NAMES.get(model_type) or "") != "MistralCommonBackend"
    import transformers

    assert all(getattr(transformers, name) is transformers.TokenizersBackend for name in GENERIC_CLASSES)
