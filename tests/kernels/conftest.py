"""The kernel tests' shared helpers live in tests/kernel_checks.py: `from kernel_checks import DEVICE, ...`."""

from __future__ import annotations

import pytest
from kernel_checks import native_isa_levels, use_native_isa


@pytest.fixture(params=native_isa_levels())
def isa(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """A test that takes it (or is marked `usefixtures("isa")`) runs once per build of the native CPU kernels
    (kernels/cpu_kernels.py: avx512, avx2, generic) that this CPU runs at or below the selected one, every native
    kernel called through that build."""
    return use_native_isa(request.param, monkeypatch)
