"""The HTTP front's tokenization per model (client/api/tokenization.py), on a direct-mode front whose engine reports a
cluster of several models: each model's requests tokenized with its own tokenizer (the one its workers report, or
--tokenizer-for's), a model whose tokenizer this host cannot read a 503 naming it (never another model's ids), a
slow load bounded in time and holding up no other model, one Tokenization per tokenizer directory, and
--tokenizer-for's checks at startup. The cluster end to end: tests/cluster/test_many_models.py."""

from __future__ import annotations

import asyncio
import logging
import shutil
import threading
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import msgspec
import pytest
from front_harness import MODEL, local_engine, serving
from front_harness import error_of as _error
from front_harness import http as _http

from infer.client.api import server, tokenization
from infer.client.api.config import FrontConfig
from infer.client.api.server import HttpFront, build_parser, front_argv, front_config
from infer.client.api.tokenization import Tokenization, Tokenizations, parse_tokenizer_for
from infer.client.local_engine import LocalEngine
from infer.protocol.messages import ClusterStats, ModelStats
from infer.protocol.outputs import RequestOutput

TEXT = "hello world , the big house"


class SeveralModels:
    """An EngineClient over a LocalEngine (MODEL's tiny Llama) that reports more models, each with the tokenizer
    places `sources` gives (ModelStats.tokenizers); their requests run on the one engine (what they generate is not
    what these tests look at: the prompts the front sends are)."""

    def __init__(self, inner: LocalEngine, sources: dict[str, list[str]], mine: list[str] | None = None) -> None:
        """`mine`: where the workers of the front's default model (the LocalEngine's) say they read its tokenizer."""
        self.inner, self.sources, self.mine = inner, sources, mine or []
        self.prompts: dict[str | None, list[list[int]]] = {}

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    async def stats(self) -> ClusterStats:
        view = await self.inner.stats()
        mine = ModelStats(
            model_id=self.inner.model_id, num_workers=1, num_healthy_workers=1, max_model_len=256, tokenizers=self.mine
        )
        others = [
            ModelStats(model_id=name, num_workers=1, num_healthy_workers=1, max_model_len=256, tokenizers=where)
            for name, where in self.sources.items()
        ]
        return msgspec.structs.replace(view, models=[mine, *others])

    async def stream(self, prompt, params=None, *, model=None, **kwargs) -> AsyncIterator[RequestOutput]:
        self.prompts.setdefault(model, []).append(list(prompt))
        async for delta in self.inner.stream(prompt, params, **kwargs):
            yield delta


@pytest.fixture(scope="module")
def local(tiny_model_dir) -> Iterator[LocalEngine]:
    engine = local_engine(tiny_model_dir("llama"))
    yield engine
    asyncio.run(engine.close())


@pytest.fixture
def words_dir(tiny_words_model, tmp_path) -> Path:
    """The word-level tokenizer's files alone (what a front on another host may have of a model)."""
    folder = tmp_path / "words-tokenizer"
    folder.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_words_model / name, folder / name)
    return folder


@contextmanager
def served(engine: Any, tokenizer: Any, tokenizers_for: Any = None, **options: Any) -> Iterator[HttpFront]:
    """An HttpFront (MODEL the default model) on a free port, served by an event loop on its own thread."""
    config = FrontConfig(served_model_name=MODEL, **options)
    front = HttpFront(engine, tokenizer, config, port=0, tokenizers_for=tokenizers_for)
    front.bind()
    thread = threading.Thread(target=asyncio.run, args=(front.serve(),), daemon=True)
    thread.start()
    try:
        yield front
    finally:
        front.shutdown()
        thread.join(10)


def exit_code(argv: list[str]) -> int:
    """infer-api's exit status for `argv` (a flag argparse refuses exits from inside it)."""
    try:
        return server.main(argv)
    except SystemExit as e:
        return int(e.code or 0)


def tokenize(url: str, model: str, text: str = TEXT) -> tuple[int, Any, str]:
    return _http(f"{url}/tokenize", {"model": model, "prompt": text})


def complete(url: str, model: str, prompt: Any = TEXT) -> tuple[int, Any, str]:
    return _http(f"{url}/v1/completions", {"model": model, "prompt": prompt, "max_tokens": 2, "temperature": 0})


def test_each_model_is_tokenized_with_the_tokenizer_its_workers_read(local, smollm2_tokenizer, tiny_words_model):
    import json

    from tiny_models import word_level_tokenizer

    words = word_level_tokenizer()
    engine = SeveralModels(local, {"words": [str(tiny_words_model)]})
    with serving(engine, smollm2_tokenizer) as url:
        status, _, text = tokenize(url, "words")
        assert status == 200, text
        assert json.loads(text)["tokens"] == words(TEXT)["input_ids"]
        status, _, text = tokenize(url, MODEL)
        assert json.loads(text)["tokens"] == smollm2_tokenizer(TEXT)["input_ids"] != words(TEXT)["input_ids"]
        assert complete(url, "words")[0] == 200 and complete(url, MODEL)[0] == 200
        mine = smollm2_tokenizer(TEXT)["input_ids"]
        assert engine.prompts == {"words": [words(TEXT)["input_ids"]], local.model_id: [mine]}
        # its own chat template, and its own vocabulary bounds token ids (SmolLM2's would take 1000)
        messages = [{"role": "user", "content": "hello there"}]
        status, _, text = _http(f"{url}/tokenize", {"model": "words", "messages": messages})
        rendered = words.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert rendered.startswith("<|user|> hello there <|end|>")
        assert json.loads(text)["tokens"] == words(rendered, add_special_tokens=False)["input_ids"]
        status, _, text = complete(url, "words", [5, 1000])
        assert status == 400 and f"outside the vocabulary [0, {len(words)})" in _error(text)["message"]
        ids = words(TEXT)["input_ids"][1:]
        status, _, text = _http(f"{url}/detokenize", {"model": "words", "tokens": ids})
        assert json.loads(text)["prompt"] == words.decode(ids) == "hello world, the big house"


def test_the_default_models_tokenizer_is_where_its_workers_read_it_else_the_fronts_model(
    local, smollm2_tokenizer, tiny_words_model, tmp_path
):
    """The model the front joined (its --served-model-name) is the first worker's when the cluster has no --model-id:
    when its workers read another tokenizer than the front's --model, theirs is used; --model's only when theirs
    is not readable here (a front on another host)."""
    import json

    from tiny_models import word_level_tokenizer

    for mine, expected in [
        ([str(tiny_words_model)], word_level_tokenizer()(TEXT)["input_ids"]),
        ([str(tmp_path / "elsewhere")], smollm2_tokenizer(TEXT)["input_ids"]),
    ]:
        with serving(SeveralModels(local, {"words": [str(tiny_words_model)]}, mine), smollm2_tokenizer) as url:
            status, _, text = tokenize(url, MODEL)
            assert status == 200 and json.loads(text)["tokens"] == expected, text


def test_a_model_whose_tokenizer_cannot_be_read_is_a_503_naming_it_and_the_others_serve(
    local, smollm2_tokenizer, tiny_words_model, tmp_path, caplog
):
    missing = tmp_path / "not-here"
    engine = SeveralModels(local, {"lost": [str(missing)], "nameless": [], "words": [str(tiny_words_model)]})
    with caplog.at_level(logging.WARNING, logger="infer.api"), served(engine, smollm2_tokenizer) as front:
        url = front.url
        for path in ("/v1/completions", "/v1/chat/completions", "/tokenize"):
            body: dict[str, Any] = {"model": "lost", "prompt": TEXT}
            if path == "/v1/chat/completions":
                body = {"model": "lost", "messages": [{"role": "user", "content": "hi"}]}
            status, headers, text = _http(f"{url}{path}", body)
            error = _error(text)
            assert (status, error["code"]) == (503, "tokenizer_unavailable"), text
            assert "cannot tokenize for the model 'lost'" in error["message"]
            assert (
                "is not readable on this host" in error["message"] and "--tokenizer-for lost=PATH" in error["message"]
            )
            assert str(tmp_path) not in text and int(headers["Retry-After"]) >= 1  # the path stays in the log
        assert "lost" not in engine.prompts  # nothing ran with another model's tokenizer
        assert str(missing) in caplog.text
        status, _, text = complete(url, "nameless")
        assert status == 503 and "its workers did not say where its tokenizer is" in _error(text)["message"]
        assert complete(url, "words")[0] == 200 and complete(url, MODEL)[0] == 200  # the failures poisoned nothing
        # its workers report a readable place later (a worker with the model joined): served at once
        engine.sources["lost"] = [str(missing), str(tiny_words_model)]
        time.sleep(1.1)  # the front's cluster view ages out
        assert complete(url, "lost")[0] == 200
        tokenizations = front.app.state.front.tokenizations
        assert tokenizations.cached("lost") is tokenizations.cached("words")  # one directory, one load


def test_a_slow_load_is_bounded_and_holds_up_no_other_model(
    local, smollm2_tokenizer, tiny_words_model, words_dir, monkeypatch
):
    """A tokenizer on a filesystem that hangs: the request gets a 503 'still loading' after load_timeout, while
    another model's tokenizer loads and the default model serves meanwhile; once the files come, it serves."""
    gate = threading.Event()
    real = tokenization.read_tokenizer

    def read(source: str):
        if source == str(tiny_words_model):
            gate.wait(30)
        return real(source)

    monkeypatch.setattr(tokenization, "read_tokenizer", read)
    engine = SeveralModels(local, {"hung": [str(tiny_words_model)], "fine": [str(words_dir)]})
    with served(engine, smollm2_tokenizer, tokenizer_load_timeout=1.0) as front:
        url = front.url
        results: dict[str, tuple[int, float]] = {}

        def timed(model: str) -> None:
            start = time.monotonic()
            status = complete(url, model)[0]
            results[model] = (status, time.monotonic() - start)

        hung = threading.Thread(target=timed, args=("hung",))
        hung.start()
        time.sleep(0.2)
        timed("fine")
        timed(MODEL)
        hung.join(60)
        # a 200 for the others: queued behind the hung load they would have met its 1 s timeout (a 503)
        assert results["fine"][0] == 200 and results[MODEL][0] == 200, results
        status, elapsed = results["hung"]
        assert status == 503 and elapsed > 0.9, results  # answered at the load timeout, not at once, not never
        status, _, text = complete(url, "hung")  # still hung: answered at once, not after another second
        assert status == 503 and "still loading the tokenizer of the model 'hung'" in _error(text)["message"]
        gate.set()
        for _ in range(50):  # the load finishes on its thread
            if front.app.state.front.tokenizations.cached("hung") is not None:
                break
            time.sleep(0.1)
        assert complete(url, "hung")[0] == 200


def test_tokenizer_for_gives_a_models_tokenizer_and_is_checked_at_startup(local, smollm2_tokenizer, words_dir, capsys):
    import json

    from tiny_models import word_level_tokenizer

    engine = SeveralModels(local, {"words": ["/nowhere/the/workers/are"]})
    tokenizers_for = tokenization.load_tokenizers_for([("words", str(words_dir))])
    with served(engine, smollm2_tokenizer, tokenizers_for, tokenizer_for=(("words", str(words_dir)),)) as front:
        status, _, text = tokenize(front.url, "words")
        assert status == 200 and json.loads(text)["tokens"] == word_level_tokenizer()(TEXT)["input_ids"]

    # the flag: NAME=PATH, repeatable, passed on to infer-serve's front; each entry checked before connecting
    args = build_parser().parse_args(
        ["--coordinator", "tcp://127.0.0.1:1", "--tokenizer-for", "a=/x", "--tokenizer-for", "b=/y", "c=/z"]
    )
    assert front_config(args, "m").tokenizer_for == (("a", "/x"), ("b", "/y"), ("c", "/z"))
    assert front_argv(args)[-4:] == ["--tokenizer-for", "a=/x", "b=/y", "c=/z"]
    for bad, why in [
        (["--tokenizer-for", "noequals"], "entries are NAME=PATH"),
        (["--tokenizer-for", "=/x"], "entries are NAME=PATH"),
        (["--tokenizer-for", "a=/x", "a=/y"], "names 'a' more than once"),
        (["--served-model-name", "m", "--tokenizer-for", "m=/x"], "'m' is this front's default model"),
        (["--tokenizer-for", f"w={words_dir.parent / 'missing'}"], "is neither a directory nor a .gguf file"),
        (["--tokenizer-for", f"w={words_dir.parent}"], "has no tokenizer files"),
    ]:
        assert exit_code(["--coordinator", "tcp://127.0.0.1:1", *bad]) == 2, bad
        err = capsys.readouterr().err
        assert why in err and "--tokenizer-for" in err, (bad, err)
    assert parse_tokenizer_for(" a = /x ") == ("a", "/x")


def test_models_that_share_a_tokenizer_directory_share_one_tokenization(smollm2_tokenizer, tiny_words_model):
    async def run() -> tuple[Tokenization, Tokenization, Tokenization]:
        tokenizations = Tokenizations(Tokenization.of(smollm2_tokenizer), Tokenization.of)
        a = await tokenizations.of("a", "a", [str(tiny_words_model)])
        b = await tokenizations.of("b", "b", [str(tiny_words_model / ".")])
        return a, b, await tokenizations.of("a", "a", [])

    a, b, again = asyncio.run(run())
    assert a is b is again and a.vocab_size == len(a.tokenizer) < 300
