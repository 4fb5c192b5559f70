"""The kernel table (kernels/dispatch.py): one per device kind, holding what the old per-call dispatchers chose.

A CPU's table runs the native kernels where their `*_takes` accepts the call and the twins otherwise; a CUDA
device with Triton runs Triton, and the twins for attention with sinks (Triton computes none); any other device,
or CUDA with INFER_KERNELS=torch, the twins. A model built through the loader holds its device's table in every
layer that runs a kernel. The CUDA table is built and its CPU-side choices run here on CPU tensors (the twins'
branch); Triton itself runs on a GPU (tests/kernels/test_*.py's Triton cases)."""

from __future__ import annotations

import pytest
import torch
from paged_cases import make_batch

from infer.kernels import cpu_kernels, dispatch
from infer.kernels.dispatch import kernels_for
from infer.kernels.paged_attention import (
    paged_decode_attention_cpu,
    paged_decode_attention_torch,
    paged_prefill_attention_cpu,
    paged_prefill_attention_torch,
)
from infer.kernels.rmsnorm import rms_norm_cpu
from infer.kernels.sampling import sample_torch, sample_triton
from infer.protocol import env
from infer.worker.loading.loader import build_model

CPU = torch.device("cpu")


def test_one_table_per_device_kind_with_the_cpus_isa() -> None:
    table = kernels_for("cpu")
    assert table is kernels_for(CPU) is kernels_for(torch.device("cpu", 0))
    assert table.backend == "cpu" and table.isa == cpu_kernels.selected_isa()
    assert table.rms_norm is rms_norm_cpu and table.sample is sample_torch
    assert table.paged_decode_attention is paged_decode_attention_cpu
    assert table.paged_prefill_attention is paged_prefill_attention_cpu
    assert table.lora_rows is cpu_kernels.lora_rows
    meta = kernels_for("meta")
    assert meta.backend == "torch" and meta.isa is None and meta.lora_rows is None


def test_cuda_runs_triton_unless_told_to_run_the_twins(monkeypatch) -> None:
    cuda = torch.device("cuda")
    monkeypatch.setattr(dispatch, "HAS_TRITON", True)
    assert dispatch._backend(cuda) == "triton"
    monkeypatch.setenv(env.KERNELS.name, "torch")
    assert dispatch._backend(cuda) == "torch"
    monkeypatch.delenv(env.KERNELS.name)
    monkeypatch.setattr(dispatch, "HAS_TRITON", False)
    assert dispatch._backend(cuda) == "torch"
    assert dispatch._backend(CPU) == "cpu"  # with or without triton: a CPU's kernels are native or twins
    triton = dispatch._table("cuda", "triton")
    assert triton.sample is sample_triton and triton.isa is None and triton.lora_rows is None


def _args(batch, mixed: bool) -> tuple:
    tables = batch.block_tables
    if mixed:
        return batch.q, batch.k_cache, batch.v_cache, tables, batch.seq_lens, batch.query_start_loc, 0.5
    return batch.q, batch.k_cache, batch.v_cache, tables, batch.seq_lens, 0.5


def test_cuda_sends_attention_with_sinks_to_the_twins() -> None:
    """The decision the old dispatchers made per call (Triton computes no sinks), now the CUDA table's: shown on
    CPU tensors, whose sink-carrying calls take the twins' branch and never reach Triton."""
    triton = dispatch._table("cuda", "triton")
    decodes = make_batch([5, 40, 17], [1, 1, 1], 6, 2, 16, 16, torch.float32, seed=3, device=CPU)
    mixed = make_batch([5, 40, 17], [1, 9, 17], 6, 2, 16, 16, torch.float32, seed=4, device=CPU)
    sinks = torch.randn(6, generator=torch.Generator().manual_seed(5))
    q, k_cache, _, tables, lens, _ = _args(decodes, mixed=False)
    assert not triton.paged_decode_takes(q, k_cache, tables, lens, sinks)
    assert triton.paged_decode_takes(q, k_cache, tables, lens, None)
    got = triton.paged_decode_attention(*_args(decodes, False), split_tokens=256, window=8, sinks=sinks)
    assert torch.equal(got, paged_decode_attention_torch(*_args(decodes, False), window=8, sinks=sinks))
    got = triton.paged_prefill_attention(*_args(mixed, True), max_query_len=17, decode_from=None, sinks=sinks)
    assert torch.equal(got, paged_prefill_attention_torch(*_args(mixed, True), max_query_len=17, sinks=sinks))


def test_the_twin_table_takes_the_cpu_tables_arguments() -> None:
    """Every table's attention takes the same call (the CPU's `decode_from` and `split_tokens` included)."""
    twins = kernels_for("meta")
    decodes = make_batch([5, 40], [1, 1], 4, 2, 16, 16, torch.float32, seed=6, device=CPU)
    mixed = make_batch([5, 40], [3, 9], 4, 2, 16, 16, torch.float32, seed=7, device=CPU)
    decode_from = torch.tensor([5, 40], dtype=torch.int32)
    assert not twins.paged_decode_takes(decodes.q, decodes.k_cache, decodes.block_tables, decodes.seq_lens, None)
    got = twins.paged_decode_attention(*_args(decodes, False), split_tokens=256)
    assert torch.equal(got, paged_decode_attention_torch(*_args(decodes, False)))
    got = twins.paged_prefill_attention(*_args(mixed, True), decode_from=decode_from)
    assert torch.equal(got, paged_prefill_attention_torch(*_args(mixed, True)))
    x, weight = torch.randn(3, 8), torch.ones(8)  # fp32 rows of a decode: the CPU's twin, the same call
    assert torch.equal(twins.rms_norm(x, weight, 1e-5, any_rows=True), kernels_for(CPU).rms_norm(x, weight, 1e-5))


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_a_built_model_holds_its_devices_table_in_every_kernel_layer(device, tiny_model_dir) -> None:
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(tiny_model_dir("qwen3"))
    model = build_model(config, torch.float32, device)
    holders = [m for m in model.modules() if hasattr(m, "kernels")]
    kinds = {type(m).__name__ for m in holders}
    assert {"RMSNorm", "RotaryEmbedding", "MergedColumnLinear", "RowLinear", "LlamaAttention", "LlamaMLP"} <= kinds
    assert all(m.kernels is kernels_for(device) for m in holders)


def test_the_cpu_table_loads_the_native_library_when_it_is_made() -> None:
    """Made at the engine's construction, the CPU table builds or loads the native library then, never in a step: a
    first step that waited on a cold cache's build (~35 s on a 2-core VM) stalled the first request, and a pipeline
    stage's peer gave up on it (--pp-timeout). In a fresh process: nothing loaded before the table, loaded after."""
    import subprocess
    import sys

    script = (
        "from infer.kernels import cpu_kernels\n"
        "from infer.kernels.dispatch import kernels_for\n"
        "before = cpu_kernels._library.cache_info().currsize\n"
        "kernels_for('cpu')\n"
        "print(before, cpu_kernels._library.cache_info().currsize, cpu_kernels._LOADED)\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600, check=True)
    loaded = "True" if cpu_kernels.native_ready() else "False"  # (False where no compiler builds it)
    assert out.stdout.split() == ["0", "1", loaded], out.stderr[-2000:]
