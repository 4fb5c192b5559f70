"""Loading weights (torch): `load_model` builds our implementation from a model directory's config.json (read by
worker/loading/model_config.py, without transformers for the Llama family) and fills
it from its *.safetensors, or from the GGUF its model.gguf links to (worker/loading/gguf.py: quantized tensors kept in
their blocks). AWQ / GPTQ int4 safetensors load as they are too (worker/loading/awq_gptq.py), FP8 ones dense
(worker/loading/fp8.py). Finding the directory (`resolve_model`), the tokenizer and the EOS ids need no torch:
worker/loading/model_files.py.
"""

from __future__ import annotations

import functools
import json
import logging
from collections.abc import Callable, Iterable, Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypeAlias, TypeVar, runtime_checkable

import torch
from torch import nn

from infer.worker.distributed.expert_parallel import ExpertParallel
from infer.worker.distributed.tensor_parallel import TensorParallel
from infer.worker.loading.awq_gptq import Int4Scheme, group_tensors, scheme_of
from infer.worker.loading.fp8 import FP8_DTYPES, Fp8Scheme, fp8_scheme_of, group_fp8_tensors
from infer.worker.loading.gguf import close_gguf_files
from infer.worker.loading.model_config import read_model_config
from infer.worker.loading.model_files import GGUF_WEIGHTS, validate_model_dir
from infer.worker.models.layers import (
    LMHead,
    PackedLinear,
    QuantStorage,
    RMSNorm,
    VocabEmbedding,
    deferred_weights,
    onednn_packs_bf16,
)
from infer.worker.models.moe import ExpertShard
from infer.worker.models.registry import model_class

if TYPE_CHECKING:
    from safetensors import safe_open

logger = logging.getLogger(__name__)

# Which part of a parameter a checkpoint tensor fills: None (all of it), a fused projection ("q", "gate"),
# or one expert's projection of a fused expert parameter.
Shard: TypeAlias = str | ExpertShard | None
T = TypeVar("T")


@runtime_checkable
class _HoldsSome(Protocol):
    """A module of an expert-parallel rank (models/moe.py): it holds some experts' shards only."""

    def holds(self, shard: Shard) -> bool: ...


@runtime_checkable
class _ShardedParams(Protocol):
    """A module that says which shards fill each of its parameters (models/layers.py, models/moe.py)."""

    def shards_of(self, param_name: str) -> tuple[Shard, ...]: ...


@runtime_checkable
class _LoadsShards(Protocol):
    """A module that copies a checkpoint tensor (or a FileTensor) into its parameter, or its shard of it."""

    def load_shard(self, param_name: str, tensor: Any, shard: Any = None) -> None: ...


# ---------------------------------------------------------------------------------------------------------
# Loading


QUANTIZATIONS = ("auto", "none", "int8", "int4")
# GGUF block types -> the storage format they are kept in (kernels/quant.py has the mapping's exactness).
GGUF_FORMATS = {
    "Q4_0": "q4",
    "Q4_1": "q4",
    "Q4_K": "q4",
    "Q8_0": "q8",
    "Q5_0": "q8",
    "Q6_K": "q8",
    "Q5_1": "q8+min",
    "Q5_K": "q8+min",
}


def load_model(
    path: Path,
    dtype: torch.dtype,
    device: torch.device,
    ep: ExpertParallel | None = None,
    tp: TensorParallel | None = None,
    quantization: str = "auto",
) -> nn.Module:
    """Our implementation of the model in directory `path`, weights loaded, on `device` in `dtype`.
    MoE models (classes with `supports_expert_parallel`) take `ep`, this rank's place in its EP group, and
    load only its experts; a dense model refuses an EP group of more than one rank. `tp`: this process's
    place in its TP group; it reads only its shard of each sharded tensor from the files. `quantization`
    (vLLM's option): "auto" keeps a GGUF's quantized tensors in their blocks, an AWQ / GPTQ int4 checkpoint's in q4
    (worker/loading/awq_gptq.py) and dense checkpoints dense (an FP8 checkpoint's weights dequantized:
    worker/loading/fp8.py), "none" makes every weight dense in `dtype`, "int8" / "int4" quantize the linear layers at
    load (weight-only, blocks of 32; the embedding and LM head int8); see `quant_plan`."""
    path = Path(path)
    validate_model_dir(path)
    files = weight_files(path)
    with deferred_weights():
        model = build_model(read_model_config(path), dtype, device, ep, tp)
    materialize(model, quant_plan(model, files, quantization), device)
    try:
        load_weights(model, files)
    finally:
        close_gguf_files()
    pack_weights(model)
    return model.eval()


def quant_plan(model: nn.Module, files: list[Path], quantization: str) -> dict[str, str]:
    """Which layers keep their weight quantized, and how: module name -> storage format ("q4", "q8", "q8+min";
    worker/models/layers.py). Layers not named are dense. A fused layer (qkv, gate_up) whose parts come in
    different formats takes "q8+min", which holds each of them (q4 exactly). Weights whose width is not a
    multiple of 32 stay dense."""
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)}, got {quantization!r}")
    layers = {name: m for name, m in model.named_modules() if isinstance(m, QuantStorage)}
    if quantization in ("int8", "int4"):
        plan = {
            name: "q8" if quantization == "int8" or isinstance(m, (VocabEmbedding, LMHead)) else "q4"
            for name, m in layers.items()
        }
    elif quantization == "auto":
        plan = _stored_plan(model, files)
    else:
        plan = {}
    return {name: fmt for name, fmt in plan.items() if layers[name].logical_shape[1] % 32 == 0}


def _stored_plan(model: nn.Module, files: list[Path]) -> dict[str, str]:
    """The storage format of each layer whose checkpoint tensors are quantized: GGUF block types, AWQ / GPTQ int4
    (none for a dense safetensors checkpoint)."""
    formats: dict[str, set[str | None]] = {}
    for key, fmt in _stored_formats(files):
        name, _shard = _parameter_of(model, key)
        module, _, param = name.rpartition(".")
        if param == "weight":
            formats.setdefault(module, set()).add(fmt)
    plan: dict[str, str] = {}
    for module, found in formats.items():
        stored = {fmt for fmt in found if fmt is not None}
        if not stored:  # dense only
            continue
        plan[module] = stored.pop() if len(found) == 1 else "q8+min"
    return plan


def _stored_formats(files: list[Path]) -> Iterator[tuple[str, str | None]]:
    """(checkpoint weight name, the storage format it keeps, None for dense) for the tensors of a GGUF file or an
    AWQ / GPTQ checkpoint (whose `<prefix>.qweight` is the q4 weight `<prefix>.weight`)."""
    from safetensors import safe_open

    scheme = _int4_scheme(files)
    for file in files:
        if file.suffix == ".gguf":
            from infer.worker.loading.gguf import open_gguf

            for key, tensor in open_gguf(file).tensors():
                yield key, GGUF_FORMATS.get(tensor.ggml_type)
        elif scheme is not None:
            with safe_open(str(file), framework="pt") as f:
                for key in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                    yield (key.removesuffix(".qweight") + ".weight", "q4") if key.endswith(".qweight") else (key, None)


def _checkpoint_config(files: list[Path]) -> dict[str, Any] | None:
    """The config.json beside safetensors `files`, None for a GGUF file or a directory without one."""
    if not files or files[0].suffix == ".gguf":
        return None
    config = files[0].parent / "config.json"
    return json.loads(config.read_text()) if config.is_file() else None


def _int4_scheme(files: list[Path]) -> Int4Scheme | None:
    """The AWQ / GPTQ scheme of safetensors `files` (their directory's config.json), None for a dense checkpoint."""
    config = _checkpoint_config(files)
    return None if config is None else scheme_of(config)


def materialize(model: nn.Module, plan: dict[str, str], device: torch.device | str) -> None:
    """Give every deferred weight of `model` (built inside `deferred_weights`) its storage on `device`: the
    format `plan` names for its layer, else dense. A tied LM head shares the embedding's storage again."""
    tied = bool(getattr(model, "lm_head_tied", False))
    for name, module in model.named_modules():
        if isinstance(module, QuantStorage) and module.weight.is_meta:
            module.materialize(plan.get(name), device)
        if isinstance(module, RMSNorm) and plan:
            module.any_rows = True
    if tied:
        model.tie_lm_head()  # type: ignore[operator]


def build_model(
    config: Any,
    dtype: torch.dtype,
    device: torch.device | str,
    ep: ExpertParallel | None = None,
    tp: TensorParallel | None = None,
) -> nn.Module:
    """Our implementation of a transformers `config` (or a worker/loading/model_config.py ModelConfig), parameters
    allocated (uninitialised) on `device` ("meta" for a shape-only twin), this TP rank's shard of it. ValueError for a
    dense model in an EP group of more than one rank, or a TP size that does not divide the heads, the vocabulary or the
    MLP."""
    cls = model_class(config)
    ep = ExpertParallel.single() if ep is None else ep
    tp = TensorParallel.single() if tp is None else tp
    moe = getattr(cls, "supports_expert_parallel", False)
    if ep.size > 1 and not moe:
        raise ValueError(
            f"an EP group of {ep.size} ranks needs an MoE model; {config.model_type!r} has no "
            "experts to shard (run its ranks as separate groups)"
        )
    with torch.device(device):
        return cls(config, dtype, ep=ep, tp=tp) if moe else cls(config, dtype, tp=tp)


def set_weight_prepack(model: Any, prepack: bool | None) -> None:
    """Whether the linears whose bf16 weights the native GEMV takes keep a oneDNN-packed copy for more than 8 rows
    (None: only on AMX-BF16 CPUs; PackedLinear.prepack), their paths chosen again. Kept by later re-packs. `model`:
    our model, or a pipeline stage's StageModel (anything whose modules() are the model's)."""
    linears = [m for m in model.modules() if isinstance(m, PackedLinear)]
    if all(m.prepack is prepack for m in linears):
        return
    if prepack and any(m.weight.dtype == torch.bfloat16 and m.weight.device.type == "cpu" for m in linears):
        if not onednn_packs_bf16():
            logger.warning(
                "--cpu-weight-prepack has no effect on this CPU: oneDNN packs bf16 weights only with avx512bw, "
                "avx512vl and avx512dq, or avx_ne_convert; the bf16 linears keep their one copy"
            )
    for module in linears:
        module.prepack = prepack
    pack_weights(model)


def pack_weights(model: nn.Module) -> None:
    """(Re)choose every linear layer's path after its weights changed (PackedLinear.pack_weights: the native GEMV,
    or a oneDNN pre-packed copy for weights it does not take) and remake the views of the quantized ones."""
    for module in model.modules():
        if isinstance(module, (PackedLinear, VocabEmbedding)):
            module.pack_weights()
        if getattr(module, "native_decode", None):
            # it holds the old weights' addresses: the next decode step makes it anew (torch's stub types a
            # module's attributes as Tensor | Module; this one is a plain attribute)
            module.native_decode = None  # type: ignore[assignment]


def weight_files(path: Path) -> list[Path]:
    """The weight files of a checkpoint: a GGUF conversion's model.gguf (worker/loading/gguf.py), else the safetensors
    files its index names, else model.safetensors, else all.

    (Some repositories also ship a consolidated.safetensors in another naming scheme; the index or
    model.safetensors tells which files belong to the transformers layout.)
    """
    if (path / GGUF_WEIGHTS).exists():
        return [path / GGUF_WEIGHTS]
    index = path / "model.safetensors.index.json"
    if index.is_file():
        return [path / name for name in sorted(set(json.loads(index.read_text())["weight_map"].values()))]
    if (path / "model.safetensors").is_file():
        return [path / "model.safetensors"]
    return sorted(path.glob("*.safetensors"))


def load_weights(model: nn.Module, files: Iterable[Path]) -> None:
    """Fill every parameter of `model` from checkpoint files, fusing q/k/v and gate/up projections and
    stacking per-expert tensors into fused expert parameters.

    ValueError naming the tensor if a checkpoint tensor fits no parameter or has the wrong shape, and
    naming the parameters left unfilled. A missing lm_head is tied to the embedding. Tensors of experts
    that another expert-parallel rank holds (the module's `holds(shard)` is False) are skipped unread.
    """
    load_named_tensors(model, file_tensors(files))


SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "F8_E4M3FNUZ": torch.float8_e4m3fnuz,
    "F8_E5M2FNUZ": torch.float8_e5m2fnuz,
    "F8_E8M0": torch.float8_e8m0fnu,
}


class FileTensor:
    """A checkpoint tensor in a safetensors file, not read yet: `shape`, `dtype`, `narrow(dim, start, length)` (reads
    only that part: a tensor-parallel rank's shard) and `read()` (all of it). What `load_shard` receives
    from the loader in place of a torch.Tensor."""

    def __init__(self, piece: Any) -> None:
        self._piece = piece  # safetensors' PySafeSlice
        self.shape = tuple(piece.get_shape())
        self.dtype = SAFETENSORS_DTYPES.get(piece.get_dtype())  # None: a type torch has no name for here

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        index = [slice(None)] * len(self.shape)
        index[dim] = slice(start, start + length)
        return self._piece[tuple(index)]

    def read(self) -> torch.Tensor:
        return self._piece[:] if self.shape else self._piece[...]


def file_tensors(files: Iterable[Path]) -> Iterator[tuple[str, Callable[[], Any], str]]:
    """(checkpoint name, a function giving the tensor as a FileTensor, where it is) for every tensor of
    `files`, read lazily."""
    from safetensors import safe_open

    files = list(files)
    config = _checkpoint_config(files)
    scheme = None if config is None else scheme_of(config)
    if scheme is not None:
        yield from _int4_file_tensors(files, scheme)
        return
    fp8 = None if config is None else fp8_scheme_of(config)
    if fp8 is not None:
        yield from _fp8_file_tensors(files, fp8)
        return
    for file in files:
        if file.suffix == ".gguf":
            from infer.worker.loading.gguf import open_gguf

            for key, tensor in open_gguf(file).tensors():
                yield key, _constant(tensor), f"in {file.name}"
            continue
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                yield key, functools.partial(_file_tensor, f, key), f"in {file.name}"


def _constant(value: T) -> Callable[[], T]:
    """A reader of a tensor already in memory."""
    return lambda: value


def _file_tensor(f: safe_open, key: str) -> FileTensor:
    """Tensor `key` of the open safetensors file `f`, not read yet. An FP8 tensor is refused here: in a checkpoint
    whose config.json declares no FP8 quantization (those read through `_fp8_file_tensors`) nothing says what
    scales it, and cast unscaled its values would be wrong."""
    tensor = FileTensor(f.get_slice(key))
    if tensor.dtype in FP8_DTYPES:
        raise ValueError(
            f"{key} is {str(tensor.dtype).removeprefix('torch.')}, but config.json has no quantization_config with "
            'quant_method "fp8" to say how it is scaled; an FP8 checkpoint needs one (worker/loading/fp8.py)'
        )
    return tensor


def _int4_file_tensors(files: list[Path], scheme: Int4Scheme) -> Iterator[tuple[str, Callable[[], Any], str]]:
    """file_tensors of an AWQ / GPTQ checkpoint: each layer's packed tensors (which may sit in different files) as
    one Int4Tensor `<prefix>.weight`, the other tensors as FileTensors."""
    with ExitStack() as stack:
        tensors, where = _open_all(stack, files)
        for name, read in group_tensors(scheme, tensors):
            yield name, read, where.get(name) or f"{where[name.removesuffix('.weight') + '.qweight']} ({scheme.method})"


def _fp8_file_tensors(files: list[Path], scheme: Fp8Scheme) -> Iterator[tuple[str, Callable[[], Any], str]]:
    """file_tensors of an FP8 checkpoint: each FP8 weight with its scale (which may sit in another file) as one
    Fp8Tensor, the other tensors as FileTensors."""
    with ExitStack() as stack:
        tensors, where = _open_all(stack, files)
        for name, read in group_fp8_tensors(scheme, tensors):
            yield name, read, where[name]


def _open_all(stack: ExitStack, files: list[Path]) -> tuple[dict[str, FileTensor], dict[str, str]]:
    """Every tensor of `files` (opened on `stack`) as an unread FileTensor, and where it is ("in <file>")."""
    from safetensors import safe_open

    tensors: dict[str, FileTensor] = {}
    where: dict[str, str] = {}
    for file in files:
        f = stack.enter_context(safe_open(str(file), framework="pt"))
        for key in f.keys():  # noqa: SIM118 (safe_open is not a dict)
            tensors[key], where[key] = FileTensor(f.get_slice(key)), f"in {file.name}"
    return tensors, where


def load_named_tensors(model: nn.Module, tensors: Iterable[tuple[str, Callable[[], torch.Tensor], str]]) -> None:
    """load_weights over (checkpoint name, tensor reader, where) triples: a whole checkpoint, complete."""
    params = dict(model.named_parameters())
    aliases = tied_aliases(model)
    loaded: set[tuple[str, Shard]] = set()
    with torch.no_grad():
        for key, read, where in tensors:
            if _unused_zero_bias(model, params, key, read):
                continue
            target = checkpoint_target(model, params, aliases, key, where)
            if target is None:
                continue
            module, name, shard = target
            load_tensor(module, name, shard, params[name], read(), f"{key!r} {where}")
            # a whole tensor fills every shard of its parameter
            filled = _shards_of(module, name.rpartition(".")[2]) if shard is None else (shard,)
            loaded.update((name, part) for part in filled)
    if "lm_head.weight" in params and not any(name == "lm_head.weight" for name, _ in loaded):
        logger.info("checkpoint has no lm_head.weight: tying it to the embedding")
        model.tie_lm_head()  # type: ignore[operator]
        params = dict(model.named_parameters())
    missing = sorted(f"{name}[{shard}]" if shard else name for name, shard in _expected(model, params) - loaded)
    if missing:
        raise ValueError(
            f"checkpoint lacks {len(missing)} weight(s) of {type(model).__name__}: "
            f"{', '.join(missing[:10])}{' ...' if len(missing) > 10 else ''}"
        )


def _unused_zero_bias(model: nn.Module, params: dict[str, nn.Parameter], key: str, read: Callable[[], Any]) -> bool:
    """Whether checkpoint tensor `key` is a bias of zeros for a linear layer that has none (older AutoGPTQ wrote one
    for every layer it quantized): skipped. A non-zero one still fails as matching no parameter."""
    if not key.endswith(".bias"):
        return False
    name, _shard = _parameter_of(model, key)
    if name in params or f"{name.removesuffix('bias')}weight" not in params:
        return False
    tensor = read()
    return not bool((tensor if isinstance(tensor, torch.Tensor) else tensor.read()).any())


def tied_aliases(model: nn.Module) -> set[str]:
    """Parameter names that are tied copies of another (a tied lm_head.weight): checkpoint tensors of these
    names are skipped, the parameter they share is filled under its own name."""
    return set(dict(model.named_parameters(remove_duplicate=False))) - set(dict(model.named_parameters()))


def checkpoint_target(
    model: nn.Module, params: dict[str, nn.Parameter], aliases: set[str], key: str, where: str = ""
) -> tuple[nn.Module, str, Shard] | None:
    """Where checkpoint tensor `key` goes in `model`: (owning module, parameter name, shard), or None for a
    tensor that is skipped (rotary caches, tied copies, another expert-parallel rank's experts, what the model's
    `skips_checkpoint_tensor(key)` says it does not run). ValueError naming the tensor if it fits no parameter."""
    if key.endswith("rotary_emb.inv_freq") or key in aliases:
        return None
    skips = getattr(model, "skips_checkpoint_tensor", None)
    if skips is not None and skips(key):
        return None
    name, shard = _parameter_of(model, key)
    if name not in params:
        raise ValueError(
            f"checkpoint tensor {key!r}{' ' + where if where else ''} matches no parameter of {type(model).__name__}"
        )
    module, _param_name = _owner(model, name)
    if isinstance(module, _HoldsSome) and not module.holds(shard):
        return None  # another rank's expert
    return module, name, shard


def _parameter_of(model: nn.Module, key: str) -> tuple[str, Shard]:
    """Checkpoint name -> (our parameter name, shard of a fused parameter or None).

    The model's class attributes say how its names differ from the checkpoint's: `checkpoint_module_renames`
    (checkpoint module name -> ours, e.g. Mixtral's block_sparse_moe -> mlp), `checkpoint_prefix_renames`
    ((checkpoint name prefix, ours), the first that matches; e.g. LLaVA's `model.language_model.` -> `model.`),
    `expert_modules_mapping`
    (per-expert module in `experts.{i}.<module>.weight` -> (fused expert parameter, projection)) and
    `packed_modules_mapping` (module -> (fused module, shard)).
    """
    renames: dict[str, str] = getattr(model, "checkpoint_module_renames", {})
    for prefix, ours in getattr(model, "checkpoint_prefix_renames", ()):
        if key.startswith(prefix):
            key = ours + key[len(prefix) :]
            break
    *modules, param_name = key.split(".")
    modules = [renames.get(module, module) for module in modules]
    experts: dict[str, tuple[str, str]] = getattr(model, "expert_modules_mapping", {})
    if (
        len(modules) >= 3
        and modules[-3] == "experts"
        and modules[-2].isdigit()
        and modules[-1] in experts
        and param_name == "weight"
    ):
        fused_param, projection = experts[modules[-1]]
        return ".".join([*modules[:-2], fused_param]), ExpertShard(projection, int(modules[-2]))
    mapping: dict[str, tuple[str, str]] = getattr(model, "packed_modules_mapping", {})
    if modules and modules[-1] in mapping:
        fused, shard = mapping[modules[-1]]
        return ".".join([*modules[:-1], fused, param_name]), shard
    return ".".join([*modules, param_name]), None


def _owner(model: nn.Module, name: str) -> tuple[nn.Module, str]:
    """Parameter name -> (the module holding it, its name there)."""
    module_name, _, param_name = name.rpartition(".")
    return model.get_submodule(module_name), param_name


def _shards_of(module: nn.Module, param_name: str) -> tuple[Shard, ...]:
    """The shards that together fill `param_name` of `module` (on this rank): (None,) for a plain one."""
    if isinstance(module, _ShardedParams):
        return tuple(module.shards_of(param_name))
    return tuple(getattr(module, "shard_names", (None,)))


def load_tensor(
    module: nn.Module, name: str, shard: Shard, param: torch.Tensor, tensor: torch.Tensor, where: str
) -> None:
    """Copy one checkpoint tensor into its parameter (or its shard of it); ValueError naming `where` on a
    bad shape."""
    try:
        if isinstance(module, _LoadsShards):
            module.load_shard(name.rpartition(".")[2], tensor, shard)
        elif shard is not None:
            raise ValueError(f"{name} is not a fused parameter")
        elif tuple(param.shape) != tuple(tensor.shape):
            raise ValueError(f"shape {tuple(tensor.shape)} != expected {tuple(param.shape)} of {name}")
        else:
            param.copy_(tensor if isinstance(tensor, torch.Tensor) else tensor.read())
    except ValueError as error:
        raise ValueError(f"checkpoint tensor {where}: {error}") from None


def _expected(model: nn.Module, params: dict[str, nn.Parameter]) -> set[tuple[str, Shard]]:
    expected: set[tuple[str, Shard]] = set()
    for name in params:
        module, param_name = _owner(model, name)
        expected.update((name, shard) for shard in _shards_of(module, param_name))
    return expected
