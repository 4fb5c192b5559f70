"""LoRA adapters served per request over one base model: PEFT's files in, a batched LoRA path in the forward.

An adapter is a PEFT LoRA folder (adapter_config.json + adapter_model.safetensors; protocol/lora.py reads and
checks the config). Each targeted linear layer W gains `scale * B A`: for input rows x, y = x W^T + scale *
(x A^T) B^T, with A [r, in], B [out, r] and scale = lora_alpha / r (lora_alpha / sqrt(r) with rsLoRA), as PEFT
computes it. Never merged into W: one batch mixes rows of several adapters and of the base model.

Weights live in `max_loras` slots (LoraSlots, worker/engine/lora_slots.py: LRU over adapters no running request holds).
Per targeted layer, `LoraLayer` holds every slot's A transposed [slots, in, subs * R] and B transposed (scale
folded in) [slots, subs * R, out], each slot contiguous, R = `max_lora_rank` (smaller ranks zero-padded); a fused
layer (qkv_proj, gate_up_proj) has one sub-block per checkpoint projection (q, k, v), B block-diagonal over them,
so one shrink and one expand matmul cover the fused output. A step's rows are laid out by slot once (`LoraStep`,
`LoraManager.step`); `LoraLayer.apply` adds each row's (x A_slot^T) B_slot^T to the base output, each row multiplied
by its own adapter only: a step of few rows (decodes) gathered into [slots, rows per slot, in] and two batched
matmuls over the slots (at most five ops a linear layer, whatever the number of adapters; on a CPU with the
native kernels, one call to kernels/cpu/lora.c instead, each row by its slot's A and B in place), a larger one
(prefills) by slices of consecutive rows of one adapter, or gathered slot groups where the runs are many. (Until
2026-11-27 a decode step multiplied every row by every slot's A and B, the other slots masked to zero: 8x the work
with 8 adapters.)
The torch ops are the native kernel's twin (and fallback, INFER_CPU_KERNELS=0) and the reference of any kernel
(none on GPU yet: the same torch ops run there); both work over dense and quantized base weights alike (they only
add to their output).

The current step's row grouping is scoped by `lora_step(...)` (the model runner enters it around the forward; it
does not nest). Steps with rows of an adapter run the layers one by one: the native CPU decode step
(worker/models/native_decode.py) and the step graphs know nothing of LoRA, and base-only steps keep them.

Tensor parallelism: each rank holds its part of A and B, sharded like the layer (`_this_ranks_part`: a
column-parallel layer's output rows split B's rows; a row-parallel layer's input columns split A's columns, and its
rank's partial (x_part A_part^T) B^T is summed by the layer's own all-reduce, added before it). TP rank 0 decides the
slots; each adapter it copies into a slot, and each forward's (slot, rows) runs, go to the other ranks with its
step commands (worker/parallel/tp_commands.py), which read the folder themselves. Pipelines are refused.
"""

from __future__ import annotations

import itertools
import logging
import re
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import torch
from torch import nn

from infer.kernels.dispatch import kernels_for
from infer.protocol.lora import ADAPTER_WEIGHTS, LORA_TARGETS, check_lora_name, read_lora_config
from infer.worker.engine.lora_slots import LoraSlots
from infer.worker.models.layers import ColumnLinear, MergedColumnLinear, PackedLinear, RowLinear

log = logging.getLogger("infer.lora")

_KEY = re.compile(r"(?:base_model\.model\.)?(?P<module>.+)\.lora_(?P<ab>[AB])(?:\.default)?\.weight")


@dataclass
class LoraAdapter:
    """One loaded adapter, on the engine's device: per (our module path, shard or None) the pair (A [r, in],
    B [out, r] * scale). `lora_id` is the engine's own (unique per load: a name loaded again is another adapter,
    and never shares prefix-cache blocks with the old one); `int_id` the caller's (vLLM's lora_int_id)."""

    name: str
    lora_id: int
    int_id: int
    path: str
    rank: int
    weights: dict[tuple[str, str | None], tuple[torch.Tensor, torch.Tensor]] = field(repr=False)


def load_adapter(
    name: str,
    path: str | Path,
    model: nn.Module,
    max_rank: int,
    lora_id: int,
    int_id: int,
    dtype: torch.dtype,
    device: torch.device,
) -> LoraAdapter:
    """Read and check a PEFT LoRA folder against `model`: ValueError naming the file, tensor or limit at fault."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    check_lora_name(name)
    folder = Path(path)
    config = read_lora_config(folder)
    weights_file = folder / ADAPTER_WEIGHTS
    if not weights_file.is_file():
        hint = (
            " (adapter_model.bin, a pickle, is not read: save with safe_serialization)"
            if (folder / "adapter_model.bin").exists()
            else ""
        )
        raise ValueError(f"{weights_file}: no such file{hint}")
    try:
        tensors = load_file(str(weights_file))
    except (SafetensorError, OSError) as e:
        raise ValueError(f"{weights_file}: not a readable safetensors file: {e}") from None
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        match = _KEY.fullmatch(key)
        if match is None:
            what = "LoRA on embeddings" if "lora_embedding" in key else "a tensor other than lora_A / lora_B"
            raise ValueError(f"{weights_file}: {key}: {what} is not supported")
        pairs.setdefault(match["module"], {})[match["ab"]] = tensor
    if not pairs:
        raise ValueError(f"{weights_file}: no lora_A / lora_B tensors")
    weights: dict[tuple[str, str | None], tuple[torch.Tensor, torch.Tensor]] = {}
    rank = 0
    for module, ab in sorted(pairs.items()):
        if set(ab) != {"A", "B"}:
            raise ValueError(f"{weights_file}: {module} has lora_{'AB'.replace(''.join(ab), '')} missing")
        target, shard, linear = _target(model, module, weights_file)
        a, b = ab["A"], ab["B"]
        r = int(a.shape[0]) if a.dim() == 2 else -1
        if a.dim() != 2 or b.dim() != 2 or b.shape[1] != r:
            raise ValueError(
                f"{weights_file}: {module}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} are not "
                f"[r, in] and [out, r]"
            )
        if r < 1:
            raise ValueError(
                f"{weights_file}: {module}: rank (r) must be >= 1, got lora_A {tuple(a.shape)} and "
                f"lora_B {tuple(b.shape)}"
            )
        if r > max_rank:
            raise ValueError(f"{weights_file}: {module} has rank {r}, above --max-lora-rank {max_rank}")
        if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
            raise ValueError(f"{weights_file}: {module} holds values that are not finite")
        try:
            a, b = _as_they_run(a, b, config.scaling(r), dtype)
            a, b = _this_ranks_part(linear, shard, a, b)
        except ValueError as e:
            raise ValueError(f"{weights_file}: {module}: {e}") from None
        weights[(target, shard)] = (a.to(device=device), b.to(device=device))
        rank = max(rank, r)
    return LoraAdapter(name, lora_id, int_id, str(folder), rank, weights)


# The most any entry of an adapter's update scale * B A may reach: float16's largest finite value. The update is added
# to the base weight's contribution, whose entries in trained models are well under 1 (as are trained adapters'
# updates: PEFT's are about 1e-3..1e-1); one of 65504 already overflows float16 activations of 1 and swamps the base
# model in any dtype, so an adapter that can reach it is a broken or hostile file (lora_alpha 1e308 made inf and
# NaN, then token 0). Judged in float64 on the checkpoint's tensors (before TP sharding: every rank agrees), the
# same in every serving dtype.
MAX_LORA_UPDATE = 65504.0


def update_bound(a: torch.Tensor, b: torch.Tensor, scale: float) -> float:
    """An upper bound of max |scale * B A| over the entries, for A [r, in] and B [out, r], in O(r (in + out)):
    |sum_k s B_ik A_kj| <= sum_k (max_i |s B_ik|) (max_j |A_kj|). Infinite or NaN when the product overflows."""
    return float(((b.double().abs().amax(dim=0) * abs(scale)) * a.double().abs().amax(dim=1)).sum())


def _as_they_run(
    a: torch.Tensor, b: torch.Tensor, scale: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """A [r, in] and B [out, r] (finite) -> A and scale * B in `dtype`, as the layers use them; ValueError when the
    update can exceed MAX_LORA_UPDATE or a scaled value does not fit `dtype`."""
    bound = update_bound(a, b, scale)
    if not bound <= MAX_LORA_UPDATE:
        raise ValueError(
            f"its update scale * B A (scale {scale:.6g}: lora_alpha / r, or / sqrt(r) with use_rslora) can reach "
            f"{bound:.3g} in one entry, above {MAX_LORA_UPDATE:g} (float16's largest): the adapter's weights or "
            "lora_alpha are broken"
        )
    a_run, b_run = a.to(dtype), (b.float() * scale).to(dtype)
    if not (torch.isfinite(a_run).all() and torch.isfinite(b_run).all()):
        raise ValueError(
            f"scale * lora_B (scale {scale:.6g}) or lora_A does not fit {str(dtype).removeprefix('torch.')}"
        )
    return a_run, b_run


def _target(model: nn.Module, module: str, where: Path) -> tuple[str, str | None, PackedLinear]:
    """Our (module path, shard, layer) for a PEFT module path (checkpoint names: q_proj -> qkv_proj's "q")."""
    parent, _, leaf = module.rpartition(".")
    if leaf not in LORA_TARGETS:
        raise ValueError(f"{where}: LoRA on {module} is not supported (targets: {', '.join(LORA_TARGETS)})")
    fused = getattr(model, "packed_modules_mapping", {}).get(leaf)
    name, shard = (f"{parent}.{fused[0]}", fused[1]) if fused else (module, None)
    try:
        linear = model.get_submodule(name)
    except AttributeError:
        raise ValueError(f"{where}: {module}: the model has no such layer") from None
    if not isinstance(linear, PackedLinear):
        raise ValueError(f"{where}: {module} is not a linear layer of this model")
    return name, shard, linear


def _this_ranks_part(
    linear: PackedLinear, shard: str | None, a: torch.Tensor, b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """A [r, in] and B [out, r] as the checkpoint has them -> this TP rank's part, sharded like the layer: a
    column-parallel layer's rows (of the projection `shard` of a fused one) split B's rows, a row-parallel layer's
    columns split A's columns (its rank's partial (x A_part^T) B^T is summed by the layer's all-reduce)."""
    out_rows, in_cols = linear.logical_shape
    in_parts, in_index, out_parts, out_index = 1, 0, 1, 0
    if isinstance(linear, MergedColumnLinear):
        fused = cast(str, shard)  # a fused layer is reached through packed_modules_mapping, which names the shard
        out_rows = linear.shard_sizes[fused]
        out_parts, out_index = linear.shard_parts[fused]
    elif isinstance(linear, RowLinear):
        in_parts, in_index = linear.tp.size, linear.tp.rank
    elif isinstance(linear, ColumnLinear):
        out_parts, out_index = linear.tp.size, linear.tp.rank
    if (a.shape[1], b.shape[0]) != (in_cols * in_parts, out_rows * out_parts):
        raise ValueError(
            f"lora_A {tuple(a.shape)} / lora_B {tuple(b.shape)} do not fit the model's layer "
            f"({out_rows * out_parts} x {in_cols * in_parts})"
        )
    return a.narrow(1, in_index * in_cols, in_cols), b.narrow(0, out_index * out_rows, out_rows)


def _subs(linear: PackedLinear) -> list[tuple[str | None, int, int]]:
    """(shard, first output row, rows) of each checkpoint projection in a layer's output."""
    if isinstance(linear, MergedColumnLinear):
        return [(s, linear.shard_offsets[s], linear.shard_sizes[s]) for s in linear.shard_names]
    return [(None, 0, linear.logical_shape[0])]


# A step of at most this many rows (decodes, mostly) takes the stacked path: its rows gathered slot by slot into
# [slots, M, in] (M: the most rows any slot has, the others padded with zero rows) and two batched matmuls over the
# slots' stacked A and B, so each row is multiplied by its own adapter alone in five ops per layer. More rows
# (prefills) go run by run or slot group by slot group, one shrink and one expand matmul each: a batched matmul over
# hundreds of bf16 rows per slot is many times slower on a CPU than the same work as plain matmuls.
STACKED_MAX_ROWS = 64

# The grouped path takes a step's runs of consecutive rows of one slot as slices (no gather or scatter) while there are
# at most this many runs per slot used; past it (decode rows of many adapters interleaved before the prefills), one
# gathered group per slot.
RUNS_PER_SLOT = 2


@dataclass(frozen=True)
class StackedRows:
    """The stacked path's layout of a step: slots `first`... `first + count - 1` (those between that no row uses get
    padding rows only), `per_slot` rows each. `index` [count * per_slot] int64: the step row in each place (padding:
    any row); `keep` [count * per_slot, 1] in the activations' dtype, 0 at padding places (None: no padding)."""

    first: int
    count: int
    per_slot: int
    index: torch.Tensor
    keep: torch.Tensor | None


@dataclass(frozen=True)
class LoraStep:
    """One forward's adapter rows: `stacked` (a step of few rows), or `groups` of (slot, rows: a slice of the step's
    rows or a row index [n] int64). Rows of the base model are in neither. A CPU step of few rows also has
    `row_slots`, for the native kernel (kernels/cpu/lora.c: every row by its own slot in one call a layer)."""

    groups: tuple[tuple[int, slice | torch.Tensor], ...] = ()
    stacked: StackedRows | None = None
    row_slots: torch.Tensor | None = None  # with `stacked` on a CPU: each row's slot, int32 [T] (-1: base model)

    @property
    def has_rows(self) -> bool:
        return self.stacked is not None or bool(self.groups)


_STEP: ContextVar[LoraStep | None] = ContextVar("infer_lora_step", default=None)


@contextmanager
def lora_step(step: LoraStep | None) -> Iterator[None]:
    """The LoRA rows of the forward run inside (None: base model only). Does not nest."""
    if _STEP.get() is not None:
        raise RuntimeError("lora_step() does not nest")
    token = _STEP.set(step)
    try:
        yield
    finally:
        _STEP.reset(token)


def lora_rows_active() -> bool:
    """Whether the current forward has rows of an adapter (the native decode step and step graphs then stand
    aside)."""
    step = _STEP.get()
    return step is not None and step.has_rows


class LoraLayer:
    """Every slot's A and B of one linear layer (module doc); `linear.lora` points here once made.

    Slot s owns `width` = subs * R ranks: `a_t[s]` [in, width] is its A transposed and `b_t[s]` [width, out] its B
    transposed (scale folded in), both contiguous, so that a slot's shrink and expand are plain matmuls
    (x [n, in] @ a_t[s] @ b_t[s]) and the stacked path multiplies a range of slots in one batched matmul each."""

    def __init__(
        self, linear: PackedLinear, num_slots: int, max_rank: int, dtype: torch.dtype, device: torch.device
    ) -> None:
        self.subs = _subs(linear)
        self.rank = max_rank
        out_features, in_features = linear.logical_shape
        self.width = len(self.subs) * max_rank
        # each sub-block's first output column and columns: the native kernel reads only B's diagonal blocks
        self.sub_first = torch.tensor([first for _, first, _ in self.subs], dtype=torch.int64)
        self.sub_cols = torch.tensor([rows for _, _, rows in self.subs], dtype=torch.int64)
        self.a_t = torch.zeros(num_slots, in_features, self.width, dtype=dtype, device=device)
        self.b_t = torch.zeros(num_slots, self.width, out_features, dtype=dtype, device=device)
        self.kernels = linear.kernels  # the device's (kernels/dispatch.py): its LoRA row kernel, if it has one

    def clear(self, slot: int) -> None:
        self.a_t[slot].zero_()
        self.b_t[slot].zero_()

    def fill(self, slot: int, shard: str | None, a: torch.Tensor, b: torch.Tensor) -> None:
        """Sub-block `shard` of `slot`: A [r, in], B [out_shard, r] (scale folded in)."""
        index = next(i for i, (s, _, _) in enumerate(self.subs) if s == shard)
        _, first, rows = self.subs[index]
        r, col = a.shape[0], index * self.rank
        self.a_t[slot, :, col : col + r].copy_(a.T)
        self.b_t[slot, col : col + r, first : first + rows].copy_(b.T)

    def apply(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """y [T, out] (the base layer's output for x [T, in]) plus each adapter row's (x A^T) B^T, in place."""
        step = _STEP.get()
        if step is None:
            return y
        stacked = step.stacked
        rows_kernel = self.kernels.lora_rows
        if (
            step.row_slots is not None
            and rows_kernel is not None
            and self.kernels.lora_rows_takes(x, y, self.a_t, self.b_t)
        ):
            return rows_kernel(x, y, step.row_slots, self.a_t, self.b_t, self.rank, self.sub_first, self.sub_cols)
        if stacked is not None:
            # [count, per_slot, in] @ [count, in, width] @ [count, width, out]: each place by its slot's A and B
            places = x.index_select(0, stacked.index)
            if stacked.keep is not None:
                places.mul_(stacked.keep)
            slots = slice(stacked.first, stacked.first + stacked.count)
            places = places.view(stacked.count, stacked.per_slot, -1)
            delta = torch.bmm(torch.bmm(places, self.a_t[slots]), self.b_t[slots])
            return y.index_add_(0, stacked.index, delta.view(stacked.count * stacked.per_slot, -1))
        for slot, rows in step.groups:
            a_t, b_t = self.a_t[slot], self.b_t[slot]
            if isinstance(rows, slice):
                y[rows].addmm_(x[rows] @ a_t, b_t)
            else:
                y.index_add_(0, rows, (x.index_select(0, rows) @ a_t) @ b_t)
        return y


class LoraManager:
    """The adapters an engine serves and their slots.

    `add` / `remove` by name (a name in use keeps serving the requests that hold it: an unloaded adapter's weights
    go once its last request ends, `collect`); `lora_id(name)` binds a new request to the adapter now under that
    name; `activate` gives a step's adapters slots (copying weights into newly placed ones); `step` groups a
    step's rows by slot."""

    def __init__(
        self,
        model: nn.Module,
        max_loras: int,
        max_lora_rank: int,
        dtype: torch.dtype,
        device: torch.device,
        base_names: tuple[str, ...] = (),
    ) -> None:
        """`base_names`: the names the base model is served under (its model id), which no adapter may take."""
        if isinstance(max_lora_rank, bool) or not isinstance(max_lora_rank, int) or max_lora_rank < 1:
            raise ValueError(f"max_lora_rank must be a positive integer, got {max_lora_rank!r}")
        self.model, self.max_rank, self.dtype, self.device = model, max_lora_rank, dtype, device
        self.kernels = kernels_for(device)
        self.base_names = base_names
        self.slots = LoraSlots(max_loras)
        self.by_name: dict[str, LoraAdapter] = {}  # what new requests may name
        self.by_id: dict[int, LoraAdapter] = {}  # and the unloaded ones requests still hold
        self.layers: dict[str, LoraLayer] = {}  # made on the first adapter that targets each layer
        self._ids = itertools.count(1)
        # TP rank 0's command channel (worker/parallel/tp_commands.py; set by the engine): each adapter copied into a
        # slot here is copied into the same slot on every other rank, from its own read of the folder (its shards)
        self.followers: Any = None

    def read(self, name: str, path: str | Path, lora_id: int, int_id: int | None = None) -> LoraAdapter:
        """An adapter's files read and checked against this rank's model (its shards), not registered."""
        return load_adapter(
            name,
            path,
            self.model,
            self.max_rank,
            lora_id,
            lora_id if int_id is None else int_id,
            self.dtype,
            self.device,
        )

    def add(self, name: str, path: str | Path, int_id: int | None = None) -> LoraAdapter:
        """Load an adapter under `name` (ValueError: the base model's name, a bad folder, a rank above max_lora_rank,
        a name taken by another path). Loading the same name and path again is a no-op."""
        check_lora_name(name)
        if name in self.base_names:
            raise ValueError(f"LoRA adapter name {name!r} is the base model's name: give the adapter another")
        current = self.by_name.get(name)
        if current is not None:
            if Path(current.path) == Path(path):
                return current
            raise ValueError(f"LoRA adapter {name!r} is already loaded from {current.path}; unload it first")
        adapter = self.read(name, path, next(self._ids), int_id)
        lora_id = adapter.lora_id
        self.by_name[name] = self.by_id[lora_id] = adapter
        log.info(
            "LoRA adapter %r loaded from %s (rank %d, %d layers)",
            name,
            adapter.path,
            adapter.rank,
            len(adapter.weights),
        )
        return adapter

    def remove(self, name: str) -> bool:
        """Unload `name`: new requests may no longer name it. False if no adapter has that name."""
        return self.by_name.pop(name, None) is not None

    def collect(self, held: set[int]) -> int:
        """Free the unloaded adapters no request in `held` (waiting or running ids) holds any more (nothing else
        refers to their weights: a slot holds a copy); returns how many."""
        gone = [i for i, a in self.by_id.items() if self.by_name.get(a.name) is not a and i not in held]
        for lora_id in gone:
            del self.by_id[lora_id]
            self.slots.drop(lora_id)
        return len(gone)

    def lora_id(self, name: str) -> int:
        adapter = self.by_name.get(name)
        if adapter is None:
            loaded = ", ".join(sorted(self.by_name)) or "none"
            raise ValueError(f"unknown LoRA adapter {name!r} (loaded: {loaded})")
        return adapter.lora_id

    def activate(self, needed: Sequence[int], running: set[int]) -> None:
        """Slots for the adapters `needed` by a step (ids > 0), evicting only adapters no running request holds."""
        for lora_id, slot in self.slots.place(needed, running):
            adapter = self.by_id[lora_id]
            if self.followers is not None:
                self.followers.lora_copy_in(adapter.name, adapter.path, lora_id, slot)
            self.copy_in(adapter, slot)

    def copy_in(self, adapter: LoraAdapter, slot: int) -> None:
        """`adapter`'s A and B into `slot` of every layer (the layers it does not target: zeros)."""
        for layer in self.layers.values():
            layer.clear(slot)
        for (module, shard), (a, b) in adapter.weights.items():
            self._layer(module).fill(slot, shard, a, b)

    def _layer(self, module: str) -> LoraLayer:
        layer = self.layers.get(module)
        if layer is None:
            linear = self.model.get_submodule(module)
            if not isinstance(linear, PackedLinear):  # _target checked it when the adapter was read
                raise ValueError(f"{module} is not a linear layer of this model")
            layer = self.layers[module] = LoraLayer(linear, self.slots.capacity, self.max_rank, self.dtype, self.device)
            linear.lora = layer
        return layer

    def slot_rows(self, row_ids: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
        """A forward's rows as (adapter id, number of rows) runs in order -> (slot, rows) runs, -1 for the base
        model's. Every adapter named must have been activated."""
        return [(-1 if not lora_id else self._slot(lora_id), n) for lora_id, n in row_ids]

    def _slot(self, lora_id: int) -> int:
        slot = self.slots.slot_of(lora_id)
        if slot is None:
            raise RuntimeError(f"LoRA adapter id {lora_id} has no slot (activate() first)")
        return slot

    def step(self, slot_rows: Sequence[tuple[int, int]]) -> LoraStep | None:
        """The LoraStep of a forward whose rows come as (slot, rows) runs in order (-1: the base model); None when
        every row is the base model's."""
        runs = slot_runs(slot_rows)
        if not runs:
            return None
        if sum(n for _, n in slot_rows) <= STACKED_MAX_ROWS:
            row_slots = None
            if self.kernels.lora_rows is not None:  # the device's row kernel (a CPU's) takes a slot per row
                row_slots = torch.tensor([slot for slot, n in slot_rows for _ in range(n)], dtype=torch.int32)
            return LoraStep(stacked=self._stacked(runs), row_slots=row_slots)
        return LoraStep(groups=self._groups(runs))

    def _stacked(self, runs: list[tuple[int, int, int]]) -> StackedRows:
        rows: dict[int, list[int]] = {}
        for slot, start, stop in runs:
            rows.setdefault(slot, []).extend(range(start, stop))
        first, last = min(rows), max(rows)
        per_slot = max(len(ids) for ids in rows.values())
        # a padding place gathers row 0 times zero: the zero delta it adds goes back to row 0
        index = [i for slot in range(first, last + 1) for i in (rows.get(slot, []) + [0] * per_slot)[:per_slot]]
        keep = None
        if len(index) > sum(len(ids) for ids in rows.values()):
            keep = (
                torch.tensor(
                    [float(p < len(rows.get(slot, ()))) for slot in range(first, last + 1) for p in range(per_slot)],
                    dtype=self.dtype,
                )
                .view(-1, 1)
                .to(self.device)
            )
        return StackedRows(
            first, last - first + 1, per_slot, torch.tensor(index, dtype=torch.int64, device=self.device), keep
        )

    def _groups(self, runs: list[tuple[int, int, int]]) -> tuple[tuple[int, slice | torch.Tensor], ...]:
        slots = {slot for slot, _, _ in runs}
        if len(runs) <= RUNS_PER_SLOT * len(slots):
            return tuple((slot, slice(start, stop)) for slot, start, stop in runs)
        rows: dict[int, list[int]] = {}
        for slot, start, stop in runs:
            rows.setdefault(slot, []).extend(range(start, stop))
        return tuple((slot, torch.tensor(ids, dtype=torch.int64, device=self.device)) for slot, ids in rows.items())

    def listing(self) -> list[dict[str, object]]:
        """The loaded adapters (name, id, path, rank), for /v1/models and LLM.list_loras."""
        return [{"name": a.name, "int_id": a.int_id, "path": a.path, "rank": a.rank} for a in self.by_name.values()]


def slot_runs(slot_rows: Sequence[tuple[int, int]]) -> list[tuple[int, int, int]]:
    """(slot, rows) runs in row order (-1: the base model) -> (slot, first row, row after the last) of the adapter
    rows, neighbouring runs of one slot merged."""
    runs: list[tuple[int, int, int]] = []
    start = 0
    for slot, n in slot_rows:
        if slot >= 0 and n > 0:
            if runs and runs[-1][0] == slot and runs[-1][2] == start:
                runs[-1] = (slot, runs[-1][1], start + n)
            else:
                runs.append((slot, start, start + n))
        start += n
    return runs
