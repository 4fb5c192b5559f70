"""Fused kernels. The Triton modules (rmsnorm, rotary, kv_append, paged_attention, quant_triton, ...) expose, per
operation `op`:
- `op_triton(...)`: launches the Triton kernel (CUDA tensors; CPU tensors under TRITON_INTERPRET=1);
- `op_torch(...)`: the twin, same signature and semantics; the test oracle, and what runs where neither Triton nor a
  native kernel does;
- `op_cpu(...)` where a native CPU kernel exists: that kernel where its `*_takes` predicate accepts the arguments,
  else the twin.

Which of them runs is chosen once per device, in dispatch.py (`kernels_for(device)`: a frozen table of one callable
per op), and nowhere else: the model's layers, the attention step, the sampler and the MoE experts take their
kernels from it.

On a CPU the hot paths are native C (cpu_kernels.py and cpu/*.c, every entry point declared once in cpu/kernels.h);
quant.py holds the quantized weights, the native matmul's wrapper and its exact twin; reference.py the plain
per-sequence definitions (the benchmarks' baseline).

Conventions: padding is a sentinel (slot -1 is skipped), offsets are computed in int64, shapes are commented at
each signature.
"""
