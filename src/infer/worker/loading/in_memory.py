"""Engines around weights already in memory (evaluation during training): no safetensors round trip.

`LLM(model=<model object>, tokenizer=...)` and `Engine(config, model=..., tokenizer=...)` take either a
transformers PreTrainedModel of a supported architecture (its tensors are copied, by their checkpoint names,
into our implementation of its config: the trainer's model is never modified or shared) or one of our own
model objects (`infer.worker.models`, used as it is, in its own dtype and device).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Callable, TypeGuard

import torch
from torch import nn

from infer.worker.distributed.expert_parallel import ExpertParallel
from infer.worker.loading.loader import build_model, load_named_tensors, pack_weights


@dataclass(frozen=True)
class InMemoryModel:
    """What an engine needs of an in-memory model."""

    model: nn.Module  # ours, weights in place, in eval mode
    tokenizer: Any
    eos_token_ids: frozenset[int]
    model_id: str


def is_our_model(model: object) -> TypeGuard[nn.Module]:
    """One of infer.worker.models' classes (the CausalLM protocol), rather than a transformers model."""
    return isinstance(model, nn.Module) and type(model).__module__.startswith("infer.worker.models")


def in_memory_model(
    model: object, tokenizer: Any, dtype: torch.dtype, device: torch.device, ep: ExpertParallel
) -> InMemoryModel:
    """Our model for `model` (see the module docstring); ValueError saying what is wrong with the arguments."""
    if tokenizer is None or not callable(tokenizer) or not hasattr(tokenizer, "decode"):
        raise ValueError(
            f"model=<an in-memory model> needs tokenizer=<its transformers tokenizer>, got {type(tokenizer).__name__}"
        )
    config = getattr(model, "config", None)
    if is_our_model(model):
        ours = model
        if ours.dtype != dtype:
            raise ValueError(
                f"the in-memory model computes in {ours.dtype}, the engine's dtype is {dtype}: "
                f"pass dtype={str(ours.dtype).removeprefix('torch.')!r}"
            )
        first = next(ours.parameters())
        if first.device.type != device.type:
            raise ValueError(f"the in-memory model is on {first.device}, the engine runs on {device}")
    elif isinstance(model, nn.Module) and config is not None and hasattr(model, "state_dict"):
        ours = build_model(config, dtype, device, ep)  # ValueError for an architecture we do not implement
        load_named_tensors(ours, _state_tensors(model))
        pack_weights(ours)
    else:
        raise ValueError(
            f"model must be a path, None, a transformers PreTrainedModel or one of infer's model "
            f"objects, got {type(model).__name__}"
        )
    return InMemoryModel(ours.eval(), tokenizer, _eos_ids(model, tokenizer), _model_id(model))


def _state_tensors(model: nn.Module) -> Iterator[tuple[str, Callable[[], torch.Tensor], str]]:
    for name, tensor in model.state_dict().items():
        yield name, tensor.detach, "in the in-memory model"


def _eos_ids(model: object, tokenizer: Any) -> frozenset[int]:
    ids: set[int] = set()
    for holder in (getattr(model, "generation_config", None), getattr(model, "config", None)):
        eos = getattr(holder, "eos_token_id", None)
        if eos is not None:
            ids.update([eos] if isinstance(eos, int) else eos)
            break
    if getattr(tokenizer, "eos_token_id", None) is not None:
        ids.add(int(tokenizer.eos_token_id))
    return frozenset(ids)


def _model_id(model: object) -> str:
    name = getattr(getattr(model, "config", None), "_name_or_path", "") or ""
    return str(name) or f"in-memory-{type(model).__name__}"
