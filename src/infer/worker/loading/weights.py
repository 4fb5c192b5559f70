"""A running engine's weights: refit (new values, all or nothing) and release / restore (suspend).

Refit. Incoming tensors carry checkpoint names (as in the model's safetensors files). `check_specs` runs the
loader's own placement and shape checks against a shape-only twin of the model on the meta device (no memory,
no copy), so a wrong name, shape or dtype is found, naming the tensor, before any parameter changes;
`WeightUpdate.stage` then reads every value into memory and refuses NaN / inf (a directory's files are
fingerprinted around the read, and `check_unchanged` refuses files that changed since: what is applied is what
was checked, and what a later reload reads). `apply_tensors` copies the staged tensors in, keeping the old
values of every parameter it touches (quantized storage's scales and mins too), and puts them all back if any
copy or the re-pack fails. A refit may be a subset of the weights (the others keep their values).

Release. `release_weights` empties every parameter (and any oneDNN pre-packed copies): to a pinned host copy
("host_copy"; on a CPU the host copy is the weights themselves, so nothing is freed), or dropped ("reload"),
restored from the files they were loaded from, or from a spill file written at release when they came from
tensors in memory (a refit from a trainer, an in-memory model). `SuspendedWeights.restore` puts them back.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, cast

import torch
from torch import nn

from infer.worker.loading.gguf import close_gguf_files
from infer.worker.loading.loader import (
    build_model,
    checkpoint_target,
    file_tensors,
    load_named_tensors,
    load_tensor,
    pack_weights,
    tied_aliases,
    weight_files,
)
from infer.worker.models.layers import PackedLinear

if TYPE_CHECKING:
    from infer.worker.models.registry import CausalLM

log = logging.getLogger("infer.worker")

WEIGHT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_SAFETENSORS_DTYPES = {
    "F32": torch.float32,
    "BF16": torch.bfloat16,
    "F16": torch.float16,
    "F64": torch.float64,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


@dataclass(frozen=True)
class TensorSpec:
    """What a refit announces of one tensor before its values: checkpoint name, shape, dtype."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype


# ---- refit -----------------------------------------------------------------------------------------------


@dataclass
class WeightUpdate:
    """One refit's tensors: their specs (checked before anything changes) and a reader of their values.
    `files` is set when they are a safetensors directory's (a later release can reload from them)."""

    specs: list[TensorSpec]
    tensors: Iterable[tuple[str, torch.Tensor]]
    files: list[Path] | None = None
    description: str = "tensors"
    staged: bool = False  # `tensors` is a list in memory, every value checked finite
    fingerprint: tuple[tuple[str, int, int, int], ...] = ()  # the files as they were read (stage)

    def stage(self) -> WeightUpdate:
        """Every value read into memory and checked finite (ValueError naming the first NaN / inf tensor, or
        saying the files changed while they were read); the specs are re-taken from the values read."""
        if self.staged:
            return self
        before = _fingerprint(self.files)
        pairs = [(name, tensor) for name, tensor in self.tensors]
        for name, tensor in pairs:
            if not bool(torch.isfinite(tensor).all()):
                raise ValueError(f"weight update: tensor {name!r} has NaN or infinite values")
        if before != _fingerprint(self.files):
            raise ValueError(f"weight update: {self.description} changed while they were read")
        specs = [TensorSpec(name, tuple(tensor.shape), tensor.dtype) for name, tensor in pairs]
        return WeightUpdate(specs, pairs, self.files, self.description, True, before)

    def check_unchanged(self) -> None:
        """ValueError if the files read by `stage` changed since (the refit waited for a drain meanwhile)."""
        if self.files is not None and self.fingerprint != _fingerprint(self.files):
            raise ValueError(
                f"weight update: {self.description} changed after they were read (while the refit "
                f"waited); nothing was applied"
            )

    @classmethod
    def of(cls, source: object) -> WeightUpdate:
        """From a safetensors directory (str / PathLike) or an iterable of (name, tensor) pairs. ValueError
        saying what is wrong with `source` itself (tensors are checked against the model by check_specs)."""
        if isinstance(source, (str, os.PathLike)):
            return cls.from_directory(Path(source))
        if isinstance(source, dict):
            source = source.items()
        if isinstance(source, (bytes, torch.Tensor)) or not isinstance(source, Iterable):
            raise ValueError(
                f"a weight source must be a safetensors directory or an iterable of (name, tensor) "
                f"pairs, got {type(source).__name__}"
            )
        return cls.from_pairs(list(source))

    @classmethod
    def from_directory(cls, path: Path) -> WeightUpdate:
        path = path.expanduser()
        if not path.is_dir():
            raise ValueError(f"weight directory {str(path)!r} does not exist or is not a directory")
        if not any(path.glob("*.safetensors")):
            raise ValueError(f"weight directory {str(path)!r} has no *.safetensors files")
        files = weight_files(path)
        return cls(_file_specs(files), _file_pairs(files), files, f"the safetensors in {path}")

    @classmethod
    def from_pairs(cls, pairs: Sequence[object]) -> WeightUpdate:
        specs = []
        checked: list[tuple[str, torch.Tensor]] = []
        for i, pair in enumerate(pairs):
            if not (
                isinstance(pair, tuple)
                and len(pair) == 2
                and isinstance(pair[0], str)
                and isinstance(pair[1], torch.Tensor)
            ):
                raise ValueError(f"weight #{i} must be a (name, torch.Tensor) pair, got {_describe(pair)}")
            checked.append((pair[0], pair[1]))
            specs.append(TensorSpec(pair[0], tuple(pair[1].shape), pair[1].dtype))
        if not specs:
            raise ValueError("the weight update is empty: no (name, tensor) pairs")
        return cls(specs, checked, None, f"{len(specs)} tensors")


def check_specs(model: nn.Module, specs: Iterable[TensorSpec]) -> None:
    """ValueError naming the first tensor that does not fit `model`: an unknown name, a name given twice, a
    dtype that is not float32 / bfloat16 / float16, a wrong shape. Nothing is allocated or changed."""
    twin = meta_twin(model)
    params = dict(twin.named_parameters())
    aliases = tied_aliases(twin)
    seen: set[str] = set()
    for spec in specs:
        if spec.name in seen:
            raise ValueError(f"weight update: tensor {spec.name!r} is given twice")
        seen.add(spec.name)
        if spec.dtype not in WEIGHT_DTYPES:
            dtype = str(spec.dtype).removeprefix("torch.")
            raise ValueError(
                f"weight update: tensor {spec.name!r} has dtype {dtype}; weights must be float32, bfloat16 or float16"
            )
        target = checkpoint_target(twin, params, aliases, spec.name, "in the weight update")
        if target is None:
            continue
        module, name, shard = target
        shape_only = torch.empty(spec.shape, dtype=spec.dtype, device="meta")
        with torch.no_grad():
            load_tensor(module, name, shard, params[name], shape_only, f"{spec.name!r} in the weight update")


def apply_tensors(model: nn.Module, tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
    """Copy checked tensors into `model` (cast to its dtype and device), then re-pack; returns how many were
    applied. All or nothing: if a copy or the re-pack raises, every touched parameter gets its old values
    back (and is re-packed) before the error propagates."""
    params = dict(model.named_parameters())
    aliases = tied_aliases(model)
    saved = _SavedParameters()
    applied = 0
    try:
        with torch.no_grad():
            for key, tensor in tensors:
                target = checkpoint_target(model, params, aliases, key, "in the weight update")
                if target is None:
                    continue
                module, name, shard = target
                saved.keep(module)
                load_tensor(module, name, shard, params[name], tensor, f"{key!r} in the weight update")
                applied += 1
        pack_weights(model)
    except BaseException:
        saved.restore()
        pack_weights(model)
        raise
    return applied


class _SavedParameters:
    """The old values of the parameters a refit touches: every direct parameter of each module written (a
    quantized layer's values, scales and mins change together), kept once, before its first write."""

    def __init__(self) -> None:
        self._saved: dict[int, list[tuple[nn.Parameter, torch.Tensor]]] = {}

    def keep(self, module: nn.Module) -> None:
        if id(module) not in self._saved:
            self._saved[id(module)] = [(p, p.detach().clone()) for p in module.parameters(recurse=False)]

    def restore(self) -> None:
        with torch.no_grad():
            for kept in self._saved.values():
                for param, old in kept:
                    param.copy_(old)
        log.warning(
            "weight update: failed while applying; the %d touched layer(s) have their old values back", len(self._saved)
        )


def meta_twin(model: nn.Module) -> nn.Module:
    """A shape-only copy of `model` on the meta device (same class, config, dtype, EP share and tying)."""
    dtype = cast("CausalLM", model).dtype  # one of our model classes, which meet the CausalLM contract
    twin = build_model(model.config, dtype, "meta", getattr(model, "ep", None), getattr(model, "tp", None))
    if getattr(model, "lm_head_tied", False) and not twin.lm_head_tied:
        cast("CausalLM", twin).tie_lm_head()  # build_model makes one of our model classes
    return twin


def _file_specs(files: list[Path]) -> list[TensorSpec]:
    from safetensors import safe_open

    specs = []
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                piece = f.get_slice(key)
                dtype = _SAFETENSORS_DTYPES.get(piece.get_dtype())
                if dtype is None:
                    raise ValueError(
                        f"weight update: tensor {key!r} in {file.name} has dtype "
                        f"{piece.get_dtype()}; weights must be float32, bfloat16 or float16"
                    )
                specs.append(TensorSpec(key, tuple(piece.get_shape()), dtype))
    return specs


class _file_pairs:
    """Iterable (re-readable) of (name, tensor) over safetensors files, one tensor in memory at a time."""

    def __init__(self, files: list[Path]) -> None:
        self.files = files

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        from safetensors import safe_open

        for file in self.files:
            with safe_open(str(file), framework="pt") as f:
                for key in f.keys():  # noqa: SIM118
                    yield key, f.get_tensor(key)


def _fingerprint(files: list[Path] | None) -> tuple[tuple[str, int, int, int], ...]:
    """(path, size, mtime ns, inode) of each file: a rewrite or a swap by rename changes it."""
    if files is None:
        return ()
    return tuple(_file_fingerprint(file) for file in files)


def _file_fingerprint(file: Path) -> tuple[str, int, int, int]:
    try:
        st = file.stat()
    except OSError:
        return str(file), -1, -1, -1  # gone: differs from any file that was read
    return str(file), st.st_size, st.st_mtime_ns, st.st_ino


def _describe(value: object) -> str:
    if isinstance(value, tuple):
        return "(" + ", ".join(type(v).__name__ for v in value) + ")"
    return type(value).__name__


# ---- release / restore -------------------------------------------------------------------------------------


@dataclass
class SuspendedWeights:
    """What `release_weights` left of a model's weights and how to put them back."""

    mode: str  # "host_copy" or "reload"
    shapes: dict[str, tuple[torch.Size, torch.dtype]]
    bytes_released: int
    host: dict[str, torch.Tensor] = field(default_factory=dict)  # host_copy: the copies
    files: list[list[Path]] = field(default_factory=list)  # reload: checkpoint files, applied in order
    spill: Path | None = None  # reload: a spill file (our parameter names)

    def restore(self, model: nn.Module, device: torch.device) -> int:
        """Put the weights back on `device`; returns the bytes restored."""
        params = dict(model.named_parameters())
        if self.mode == "host_copy":
            for name, host in self.host.items():
                params[name].data = host.to(device, non_blocking=True)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            self.host.clear()
        else:
            for name, (shape, dtype) in self.shapes.items():
                params[name].data = torch.empty(shape, dtype=dtype, device=device)
            self._reload(model)
        pack_weights(model)
        return _param_bytes(model) if self.bytes_released else 0

    def _reload(self, model: nn.Module) -> None:
        if self.spill is not None:
            _load_spill(model, self.spill)
            self.spill = None
            return
        for layer, files in enumerate(self.files):
            if layer == 0:  # the base checkpoint: complete
                load_named_tensors(model, file_tensors(files))
                close_gguf_files()
            else:  # refits from directories, in order
                apply_tensors(model, _file_pairs(files))

    def discard(self) -> None:
        if self.spill is not None:
            shutil.rmtree(self.spill.parent, ignore_errors=True)
            self.spill = None


def release_weights(
    model: nn.Module, mode: str, device: torch.device, files: list[list[Path]] | None
) -> SuspendedWeights:
    """Empty every parameter of `model` (see the module docstring). `files`: the checkpoint files the current
    weights came from, in order (a base checkpoint, then refits from directories), or None when some came from
    tensors in memory (then "reload" spills them to a temporary file first)."""
    if mode == "auto":
        mode = "host_copy" if device.type == "cuda" else "reload"
    params = dict(model.named_parameters())
    shapes = {name: (p.shape, p.dtype) for name, p in params.items()}
    released = 0 if mode == "host_copy" and device.type == "cpu" else _param_bytes(model)
    suspended = SuspendedWeights(mode, shapes, released)
    if mode == "host_copy":
        if device.type == "cpu":
            log.info("suspend: the weights are kept in host memory (suspend_weights=host_copy on a CPU)")
            return suspended
        for name, p in params.items():
            host = torch.empty(p.shape, dtype=p.dtype, device="cpu", pin_memory=True)
            host.copy_(p.data)
            suspended.host[name] = host
    elif files is None:
        spill_dir = Path(tempfile.mkdtemp(prefix="infer-suspended-weights-"))
        suspended.spill = spill_dir / "weights.safetensors"
        _save_spill(model, suspended.spill)
    else:
        suspended.files = [list(layer) for layer in files]
    for module in model.modules():
        if isinstance(module, PackedLinear):
            module.packed = None
    for p in params.values():
        p.data = torch.empty(0, dtype=p.dtype, device=p.device)
    return suspended


def packed_bytes(model: nn.Module) -> int:
    """Bytes of the oneDNN pre-packed copies of the linear weights that keep one (fp32; bf16 where the native GEMV
    is missing), released with the weights."""
    return sum(_nbytes(m.packed) for m in model.modules() if isinstance(m, PackedLinear) and m.packed is not None)


def _param_bytes(model: nn.Module) -> int:
    return sum(_nbytes(p) for p in model.parameters()) + packed_bytes(model)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _save_spill(model: nn.Module, path: Path) -> None:
    from safetensors.torch import save_file

    save_file({name: p.detach().contiguous().cpu() for name, p in model.named_parameters()}, str(path))


def _load_spill(model: nn.Module, path: Path) -> None:
    from safetensors import safe_open

    params = dict(model.named_parameters())
    with torch.no_grad(), safe_open(str(path), framework="pt") as f:
        for name in f.keys():  # noqa: SIM118
            params[name].copy_(f.get_tensor(name))
    shutil.rmtree(path.parent, ignore_errors=True)
