"""Triton, when it is installed and can run here; otherwise stand-ins that let the kernel modules import.

Triton ships for Linux only. Elsewhere `HAS_TRITON` is False, the `@triton.jit` functions become
placeholders that raise when launched, and the engine runs the PyTorch twins (kernels/dispatch.py). The same
holds on a machine without CUDA, unless TRITON_INTERPRET=1 (the CPU test mode): there no kernel could launch,
and importing triton would cost every CPU worker about 70 MiB of resident memory (libtriton) for nothing.
"""

from __future__ import annotations

import os
from typing import Any

import torch


def interpreting() -> bool:
    """True under TRITON_INTERPRET=1 (the CPU test mode: kernels run in Triton's NumPy interpreter)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


HAS_TRITON = False
if interpreting() or torch.cuda.is_available():  # somewhere a Triton kernel can launch
    try:
        import triton
        import triton.language as tl

        HAS_TRITON = True
    except ImportError:  # pragma: no cover - exercised only where triton has no wheel
        pass

if not HAS_TRITON:

    class _Unavailable:
        def __init__(self, fn: Any) -> None:
            self.__name__ = getattr(fn, "__name__", "kernel")

        def __getitem__(self, grid: Any) -> Any:
            raise RuntimeError(f"{self.__name__}: triton is not installed; use the PyTorch twin")

        def __call__(self, *args: Any, **kwargs: Any) -> Any:
            raise RuntimeError(f"{self.__name__}: triton is not installed; use the PyTorch twin")

    class _TritonStandIn:
        @staticmethod
        def jit(fn: Any = None, **kwargs: Any) -> Any:
            return _Unavailable(fn) if fn is not None else _Unavailable

        @staticmethod
        def cdiv(a: int, b: int) -> int:
            return -(-a // b)

        @staticmethod
        def next_power_of_2(n: int) -> int:
            return 1 << max(0, int(n) - 1).bit_length()

    class _LanguageStandIn:
        constexpr = Any  # only used as an annotation by the kernels' signatures

    triton = _TritonStandIn()  # type: ignore[assignment]
    tl = _LanguageStandIn()  # type: ignore[assignment]

__all__ = ["HAS_TRITON", "interpreting", "tl", "triton"]
