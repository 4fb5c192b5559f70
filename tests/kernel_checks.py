"""Shared pieces of the kernel tests (tests/kernels/): the device, per-dtype tolerances, NaN-poisoned outputs.
Import them as `from kernel_checks import ...` (tests/ is on the path).

On a CPU-only machine the Triton kernels run under TRITON_INTERPRET=1 (set in tests/conftest.py before
anything imports infer.kernels), in fp32 and fp16 (bf16 `tl.dot` is broken in the interpreter). On a
CUDA machine they are compiled and bf16 joins the dtypes.
"""

from __future__ import annotations

import pytest
import torch

from infer.kernels._triton import HAS_TRITON, interpreting

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")

# Kernel dtypes tested against the float64 reference and the twin: (atol, rtol) of the comparison.
TOLERANCES: dict[torch.dtype, tuple[float, float]] = {
    torch.float32: (2e-5, 2e-5),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (1.6e-2, 1.6e-2),
}
KERNEL_DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE.type == "cuda" else [])

requires_triton = pytest.mark.skipif(
    not HAS_TRITON or (DEVICE.type == "cpu" and not interpreting()),
    reason="needs triton (compiled on CUDA, or TRITON_INTERPRET=1 on CPU)",
)


def poisoned(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device = DEVICE) -> torch.Tensor:
    """An output buffer full of NaN, so that any element a kernel fails to write fails the comparison."""
    return torch.full(shape, float("nan"), dtype=dtype, device=device)


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, what: str = "") -> None:
    """actual vs expected (any dtypes) within `dtype`'s stated tolerance; NaN anywhere fails."""
    atol, rtol = TOLERANCES[dtype]
    assert not torch.isnan(actual).any(), f"{what}: NaN in the output (an element was not written)"
    torch.testing.assert_close(
        actual.double().cpu(), expected.double().cpu(), atol=atol, rtol=rtol, msg=lambda m: f"{what}: {m}"
    )


def native_isa_levels() -> tuple[str, ...]:
    """The builds of the native CPU kernels the `isa` fixtures run over: those this CPU runs at or below the selected
    one (INFER_CPU_ISA=avx2 on an AVX-512 machine tests as an AVX2-only CPU would); ("refused",) where
    INFER_CPU_ISA names a level this CPU cannot run, so that the tests fail on it."""
    from infer.kernels import cpu_kernels

    try:
        return cpu_kernels.isas_at_or_below(cpu_kernels.selected_isa())
    except ValueError:
        return ("refused",)


def use_native_isa(isa: str, monkeypatch: pytest.MonkeyPatch) -> str:
    """Route every native kernel call of the test through the `isa` build; skip where none can be built."""
    from infer.kernels import cpu_kernels

    if isa == "refused":
        cpu_kernels.selected_isa()  # raises the ValueError that says why
    lib = cpu_kernels.library(isa)
    if lib is None:
        pytest.skip("no native CPU kernels (no C compiler, or INFER_CPU_KERNELS=0): the twins run instead")
    monkeypatch.setattr(cpu_kernels, "_library", lambda: lib)
    return isa
