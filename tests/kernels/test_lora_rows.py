"""The native LoRA decode step (kernels/cpu/lora.c, `cpu_kernels.lora_rows`) against its torch twin (worker/engine/lora.py's
stacked path: gather, two batched matmuls, scatter-add) and float64: fused layers with per-projection sub-blocks,
adapters of smaller rank than the slots' (zero-padded ranks), slots no row uses, cleared slots, and base rows
(slot -1), which must keep their bits."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from infer.kernels.cpu_kernels import lora_rows, lora_rows_takes
from infer.worker.engine.lora import LoraLayer, LoraManager, lora_step
from infer.worker.models.layers import ColumnLinear, MergedColumnLinear, RowLinear

pytestmark = pytest.mark.usefixtures("isa")  # every test once per build this CPU runs (conftest.py)

CPU = torch.device("cpu")
MAX_RANK = 8
NUM_SLOTS = 5

# (name, the layer, its sub-blocks as (shard, output rows)); SmolLM2-135M's shapes (hidden 576, 9 + 3 + 3 heads of
# 64, intermediate 1536): q and gate_up's halves cross the kernel's 512-column passes
LAYERS = {
    "qkv": lambda dtype: MergedColumnLinear(576, {"q": 576, "k": 192, "v": 192}, False, dtype),
    "gate_up": lambda dtype: MergedColumnLinear(576, {"gate": 1536, "up": 1536}, False, dtype),
    "down": lambda dtype: RowLinear(1536, 576, False, dtype),
    "odd": lambda dtype: ColumnLinear(37, 13, False, dtype),
}

# (slot, rows) runs of a decode step (-1: the base model); slot 2 is never used, slot 4 is cleared
STEPS = {
    "mixed, padded slots": [(-1, 2), (3, 3), (1, 1), (-1, 1), (1, 1), (0, 4), (4, 1)],
    "one row": [(3, 1)],
    "32 rows of 4 adapters and the base": [(i % 5 - 1 if i % 5 != 3 else 4, 1) for i in range(32)],
}


def _filled_layer(linear, dtype: torch.dtype, seed: int) -> tuple[LoraLayer, dict]:
    """Slots 0, 1, 3 hold adapters of ranks 8, 5 and 3 (every sub-block), slot 2 random values no row reads, slot 4
    cleared; returns the layer and the float64 (A, B) per (slot, shard)."""
    gen = torch.Generator().manual_seed(seed)
    layer = LoraLayer(linear, num_slots=NUM_SLOTS, max_rank=MAX_RANK, dtype=dtype, device=CPU)
    out_features, in_features = linear.logical_shape
    pairs = {}
    for slot, rank in ((0, 8), (1, 5), (2, 8), (3, 3), (4, 8)):
        for shard, _, rows in layer.subs:
            a = torch.randn(rank, in_features, generator=gen) / in_features**0.5
            b = torch.randn(rows, rank, generator=gen)
            layer.fill(slot, shard, a.to(dtype), b.to(dtype))
            pairs[slot, shard] = a.to(dtype).double(), b.to(dtype).double()
    layer.clear(4)
    return layer, pairs


def _reference(
    layer: LoraLayer, pairs: dict, x: torch.Tensor, y: torch.Tensor, slots: list[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 y + (x A^T) B^T per row, and the magnitude its roundings scale with: |y| + sum_r |t_r| |B_r|."""
    expected, magnitude = y.double(), y.double().abs()
    for row, slot in enumerate(slots):
        if slot in (-1, 4):
            continue
        for shard, first, rows in layer.subs:
            a, b = pairs[slot, shard]
            t = x[row].double() @ a.T
            expected[row, first : first + rows] += t @ b.T
            magnitude[row, first : first + rows] += t.abs() @ b.abs().T
    return expected, magnitude


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("layer_name", LAYERS)
@pytest.mark.parametrize("step_name", STEPS)
def test_native_matches_twin_and_float64(dtype, layer_name, step_name):
    linear = LAYERS[layer_name](dtype)
    layer, pairs = _filled_layer(linear, dtype, seed=len(layer_name) * 7 + len(step_name))
    out_features, in_features = linear.logical_shape
    slot_rows = STEPS[step_name]
    slots = [slot for slot, n in slot_rows for _ in range(n)]
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(len(slots), in_features, generator=gen).to(dtype)
    y = torch.randn(len(slots), out_features, generator=gen).to(dtype)
    manager = LoraManager(torch.nn.Module(), max_loras=NUM_SLOTS, max_lora_rank=MAX_RANK, dtype=dtype, device=CPU)
    step = manager.step(slot_rows)
    assert step is not None and step.row_slots is not None and step.row_slots.tolist() == slots
    assert lora_rows_takes(x, y, layer.a_t, layer.b_t)
    with lora_step(step):
        native = layer.apply(x, y.clone())
    with lora_step(dataclasses.replace(step, row_slots=None)):  # the twin: the stacked torch path
        twin = layer.apply(x, y.clone())
    base = torch.tensor([s in (-1, 4) for s in slots])
    assert torch.equal(native[base], y[base]), "rows of the base model (and of a cleared slot) keep their bits"
    expected, magnitude = _reference(layer, pairs, x, y, slots)
    if dtype == torch.float32:
        torch.testing.assert_close(native.double(), expected, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(native, twin, rtol=1e-5, atol=1e-5)
    else:
        # t, the delta and y + delta each rounded to bf16 (2^-9 relative each) as the twin rounds them; the sums'
        # order differs, so a rounding may land one ulp apart: both within 2^-6 of the magnitude from float64
        bound = magnitude * 2.0**-6 + 1e-30
        assert ((native.double() - expected).abs() <= bound).all()
        assert ((twin.double() - expected).abs() <= bound).all()
        assert (native != twin).float().mean() < 0.05


def test_refusals_are_precise_errors():
    linear = LAYERS["odd"](torch.float32)
    layer, _ = _filled_layer(linear, torch.float32, seed=1)
    x, y = torch.randn(3, 37), torch.randn(3, 13)
    before = y.clone()
    slots = torch.tensor([0, 1, -1], dtype=torch.int32)
    subs = layer.sub_first, layer.sub_cols
    with pytest.raises(ValueError, match="slot past the 5 slots"):
        lora_rows(x, y, torch.tensor([0, 5, -1], dtype=torch.int32), layer.a_t, layer.b_t, MAX_RANK, *subs)
    with pytest.raises(ValueError, match=r"slots must be int32 \[3\]"):
        lora_rows(x, y, torch.tensor([0, 1, -1]), layer.a_t, layer.b_t, MAX_RANK, *subs)
    with pytest.raises(ValueError, match="sub-blocks outside 13 columns"):
        lora_rows(x, y, slots, layer.a_t, layer.b_t, MAX_RANK, torch.tensor([6]), torch.tensor([8]))
    with pytest.raises(ValueError, match="do not make width 8"):
        lora_rows(x, y, slots, layer.a_t, layer.b_t, 4, *subs)
    assert torch.equal(y, before), "a refused call writes nothing"
    assert not lora_rows_takes(torch.randn(37, 3).T, y, layer.a_t, layer.b_t), "columns must be unit stride"
    assert not lora_rows_takes(x.double(), y.double(), layer.a_t.double(), layer.b_t.double())
