"""What the front takes from the command line or the checkpoint besides its weights: `--chat-template` (vLLM's
flag: a file, or the template itself) and `--generation-config` (vLLM's `auto | vllm | PATH`): the sampling
defaults of a checkpoint's generation_config.json.

Generation defaults: with `auto` (the default, as in vLLM) the served model's directory is read, with a PATH that
folder's generation_config.json (or that file), with `vllm` nothing. Of it, vLLM's fields are taken: temperature,
top_p, top_k, min_p, repetition_penalty, and max_new_tokens as max_tokens. They replace the front's own defaults
for a request that leaves the field out; a value the request gives always wins. The front logs which it applied.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

log = logging.getLogger("infer.api")

GENERATION_FIELDS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}
MAX_CHAT_TEMPLATE_BYTES = 1 << 20


def load_chat_template(value: str) -> str:
    """`--chat-template`: the text of the file it names, else the value itself when it looks like a template (it
    has `{`, `}` or a newline; vLLM's rule); ValueError for a path that cannot be read or a template jinja cannot
    parse (with its line)."""
    path = Path(value)
    if not any(c in value for c in "{}\n"):
        try:
            if path.stat().st_size > MAX_CHAT_TEMPLATE_BYTES:
                raise ValueError(f"--chat-template {value}: larger than {MAX_CHAT_TEMPLATE_BYTES} bytes")
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            why = getattr(e, "strerror", None) or e
            raise ValueError(
                f"--chat-template {value}: not a template (no '{{', '}}' or newline) and not a readable file: {why}"
            ) from None
        where = value
    else:
        text, where = value, "the template given"
    import jinja2

    try:
        jinja2.Environment().parse(text)
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(f"--chat-template: {where}, line {e.lineno}: {e.message}") from None
    return text


def matryoshka_dimensions(model_dir: str | os.PathLike[str] | None) -> tuple[int, ...] | None:
    """The embedding sizes a Matryoshka model allows (vLLM reads the same keys of config.json): its
    `matryoshka_dimensions`, () for `is_matryoshka` (any size), None for any other model (or no directory)."""
    if model_dir is None:
        return None
    try:
        config = json.loads((Path(model_dir) / "config.json").read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError):
        return None
    sizes = config.get("matryoshka_dimensions") if isinstance(config, dict) else None
    if isinstance(sizes, list) and sizes and all(isinstance(d, int) and d > 0 for d in sizes):
        return tuple(sizes)
    return () if isinstance(config, dict) and config.get("is_matryoshka") is True else None


def generation_defaults(setting: str, model_dir: str | os.PathLike[str] | None) -> dict[str, Any]:
    """The sampling defaults `--generation-config` gives (module doc); ValueError naming the file and field for
    a file that cannot be read or a value of the wrong type."""
    if setting == "vllm":
        return {}
    if setting == "auto":
        if model_dir is None:
            return {}
        path = Path(model_dir) / "generation_config.json"
        if not path.is_file():
            return {}
    else:
        path = Path(setting)
        path = path / "generation_config.json" if path.is_dir() else path
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as e:
        why = getattr(e, "strerror", None) or e
        raise ValueError(f"--generation-config: cannot read {path}: {why}") from None
    if not isinstance(config, dict):
        raise ValueError(f"--generation-config: {path} is not a JSON object")
    defaults = {}
    for name, field in GENERATION_FIELDS.items():
        value = config.get(name)
        if value is None:
            continue
        wants_int = field in ("top_k", "max_tokens")
        if isinstance(value, bool) or not isinstance(value, int if wants_int else (int, float)):
            raise ValueError(
                f"--generation-config: {path}: {name} must be {'an integer' if wants_int else 'a number'}"
                f", got {value!r}"
            )
        defaults[field] = value
    from infer.protocol.sampling import SamplingParams

    try:
        fields: dict[str, Any] = {k: v for k, v in defaults.items()}  # SamplingParams fields, typed as checked above
        SamplingParams(**fields)
    except ValueError as e:
        raise ValueError(f"--generation-config: {path}: {e}") from None
    if defaults:
        log.info(
            "generation config %s: defaults for requests that leave them out: %s",
            path,
            ", ".join(f"{k}={v}" for k, v in defaults.items()),
        )
    return defaults
