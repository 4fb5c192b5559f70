"""Which CPU attention kernels a model's layers took: the dispatchers' (kernels/paged_attention.py) calls of the
native kernels and of the twins, counted, for model tests that must show the native path is taken."""

from __future__ import annotations

import pytest

from infer.kernels import cpu_kernels, paged_attention


def count_attention_kernels(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """Calls of the CPU attention kernels the dispatchers (kernels/paged_attention.py) pick, by kernel, from now on."""
    calls = dict.fromkeys(
        (
            "paged_decode_attention_native",
            "paged_prefill_attention_native",
            "paged_decode_attention_torch",
            "paged_prefill_attention_torch",
        ),
        0,
    )
    for name in calls:
        kernel = getattr(paged_attention, name)

        def call(*args, _name=name, _kernel=kernel, **kwargs):
            calls[_name] += 1
            return _kernel(*args, **kwargs)

        monkeypatch.setattr(paged_attention, name, call)
    return calls


def assert_native_attention(calls: dict[str, int]) -> None:
    """Every decode and prefill attention call went to the native kernels (where they are built), none to the twins."""
    if not cpu_kernels.native_ready():
        pytest.skip("no native CPU kernels here (INFER_CPU_KERNELS=0 or no compiler)")
    assert calls["paged_decode_attention_native"] > 0 and calls["paged_prefill_attention_native"] > 0, calls
    assert calls["paged_decode_attention_torch"] == calls["paged_prefill_attention_torch"] == 0, calls
