"""Fused kernels: each a Triton kernel plus a PyTorch twin of the same signature.

Every module exposes, per operation `op`:
- `op_triton(...)`: launches the Triton kernel (CUDA tensors; CPU tensors under TRITON_INTERPRET=1);
- `op_torch(...)`: the twin, same signature and semantics; the CPU hot path and the test oracle;
- `op(...)`: picks Triton on CUDA devices and the twin elsewhere (`_triton.use_triton`).

Conventions (../shared/DESIGN.md): padding is a sentinel (slot -1 is skipped), offsets are computed in
int64, shapes are commented at each signature.
"""
