"""The native quantized matmul (kernels/cpu/quant.c) against its twin and float64, in every ISA build this CPU runs.

kernels/cpu/quant.c is compiled here on its own once per target the library's builds use: -march=native (on an
AVX-512 VNNI CPU, the vpdpbusd path), -march=x86-64-v3 (AVX2 + FMA + F16C), -march=x86-64-v2 and -march=x86-64
(plain C, software fp16), each loaded with ctypes and driven through `quant_matmul(..., lib=build)`. A target whose
ISA macros (those the source's `#if` lines test) equal an earlier one's compiles the same code paths: it is skipped,
saying which (on a Zen 3, native is x86-64-v3, and x86-64-v2 is x86-64). The package's own library
(kernels/cpu_kernels.py) is checked once more through the default path.

What the kernel promises: the activations' int8 quantization and the integer block dots are exact, the scale
products are the twin's fp32 products, and only the fp32 sum of the block terms (split into SIMD lanes) runs in
another order. So the kernel is within (blocks + 8) * 2^-23 * magnitude of the twin's float64 total, magnitude
being the sum of |d_w d_x| (|q_w| . |q_x|) + |m_w s_x| over the blocks (`block_products`; it bounds every partial
sum of any split into lanes), which is the error bound of an fp32 sum of that depth, twice over; plus one bf16
rounding of each side for bf16 output.
"""

from __future__ import annotations

import ctypes
import math
import re
import subprocess
from pathlib import Path

import pytest
import torch

from infer.kernels import cpu_kernels
from infer.kernels.quant import (
    BLOCK,
    QuantWeight,
    bind,
    block_products,
    pack_q4,
    quant_matmul,
    quant_matmul_reference,
    quant_matmul_takes,
    quantize,
    quantize_activations,
    unpack_q4,
)

SOURCE = Path(cpu_kernels.__file__).resolve().parent / "cpu" / "quant.c"
BUILD_FLAGS = ("-O3", "-fopenmp", "-shared", "-fPIC", "-std=gnu11", "-ffp-contract=fast")  # cpu_kernels.FLAGS
# -march of each build, and the CPU flags it needs to run here
ISAS = {
    "native": ("native", ()),
    "x86-64-v3": ("x86-64-v3", ("avx2", "fma", "f16c", "bmi1", "bmi2", "movbe", "abm")),
    "x86-64-v2": ("x86-64-v2", ("ssse3", "sse4_1", "sse4_2", "popcnt")),
    "x86-64": ("x86-64", ()),
}
FORMATS = ("q4", "q8", "q8-affine")
DTYPES = (torch.float32, torch.bfloat16)


def _cpu_flags() -> set[str]:
    return set(cpu_kernels._cpu_flags().split())


def _isa_macros(compiler: str, march: str) -> frozenset[str]:
    """The macros the kernel's `#if` lines test (its own and common.h's) that `-march=march` predefines."""
    tested = set()
    for source in (SOURCE, SOURCE.parent / "common.h"):
        for line in source.read_text().splitlines():
            if line.lstrip().startswith(("#if", "#elif")):
                tested.update(re.findall(r"__[A-Z0-9_]+__", line))
    out = subprocess.run(
        [compiler, f"-march={march}", "-dM", "-E", "-"], input="", capture_output=True, text=True, check=True
    ).stdout
    return frozenset(name for name in re.findall(r"#define (__[A-Z0-9_]+__) ", out) if name in tested)


@pytest.fixture(scope="session")
def builds(tmp_path_factory: pytest.TempPathFactory) -> dict[str, ctypes.CDLL | str]:
    """ISA name -> its build, or (a str) the earlier ISA whose code paths it would compile again."""
    compiler = cpu_kernels._compiler()
    if compiler is None:
        pytest.skip("no C compiler")
    out, libs = tmp_path_factory.mktemp("quant-builds"), {}
    seen: dict[frozenset[str], str] = {}
    for name, (march, needs) in ISAS.items():
        if not set(needs) <= _cpu_flags():
            continue
        macros = _isa_macros(compiler, march)
        if macros in seen:
            libs[name] = seen[macros]
            continue
        seen[macros] = name
        target = out / f"quant-{name}.so"
        subprocess.run(
            [compiler, *BUILD_FLAGS, f"-march={march}", "-o", str(target), str(SOURCE), "-lm"],
            check=True,
            capture_output=True,
            timeout=120,
        )
        libs[name] = bind(ctypes.CDLL(str(target)))
    return libs


@pytest.fixture(params=list(ISAS))
def build(request: pytest.FixtureRequest, builds: dict[str, ctypes.CDLL | str]) -> ctypes.CDLL:
    if request.param not in builds:
        pytest.skip(f"this CPU does not run the {request.param} build")
    lib = builds[request.param]
    if isinstance(lib, str):
        pytest.skip(f"the {request.param} build compiles the code paths of the {lib} build on this CPU")
    return lib


def make_weight(fmt: str, n: int, k: int, seed: int) -> QuantWeight:
    """q4 and q8 from our quantizer on a random dense weight; q8-affine: random q over all of -128..127 with random
    fp16 scales and mins."""
    g = torch.Generator().manual_seed(seed)
    if fmt != "q8-affine":
        return quantize(torch.randn(n, k, generator=g) / k**0.5, fmt)
    q = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8)
    scales = (torch.rand(n, k // BLOCK, generator=g) * 0.02).to(torch.float16)
    mins = (torch.randn(n, k // BLOCK, generator=g) * 0.1).to(torch.float16)
    return QuantWeight("q8", q, scales, mins)


def make_x(m: int, k: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Gaussian rows whose blocks differ in scale by up to 1000x (as activations with outlier channels do)."""
    g = torch.Generator().manual_seed(seed + 1)
    block_scale = torch.exp(torch.rand(m, k // BLOCK, 1, generator=g) * 7 - 3.5)
    return (torch.randn(m, k // BLOCK, BLOCK, generator=g) * block_scale).reshape(m, k).to(dtype)


def dequantize64(weight: QuantWeight) -> torch.Tensor:
    """W [N, K] in float64, each element scale * q + min exactly."""
    q = unpack_q4(weight.qs) if weight.format == "q4" else weight.qs
    n, k = weight.shape
    values = q.double().reshape(n, -1, BLOCK) * weight.scales.double().unsqueeze(-1)
    if weight.mins is not None:
        values = values + weight.mins.double().unsqueeze(-1)
    return values.reshape(n, k)


def twin_tolerance(x: torch.Tensor, weight: QuantWeight, total: torch.Tensor, magnitude: torch.Tensor) -> torch.Tensor:
    """How far the kernel may be from the twin's float64 total: an fp32 sum's rounding over the block terms (and the
    min terms, the lanes and the horizontal sum), and for bf16 one rounding of each side."""
    tol = (weight.shape[1] // BLOCK + 8) * 2.0**-23 * magnitude
    if x.dtype == torch.bfloat16:
        tol = tol + 2.0**-7 * (total.abs() + tol)
    return tol


def assert_matches_twin(got: torch.Tensor, x: torch.Tensor, weight: QuantWeight) -> None:
    total, magnitude = block_products(x, weight)
    assert got.shape == total.shape and got.dtype == x.dtype
    assert ((got.double() - total).abs() <= twin_tolerance(x, weight, total, magnitude)).all()
    twin = quant_matmul_reference(x, weight)
    assert (
        twin.dtype == x.dtype and ((twin.double() - total).abs() <= twin_tolerance(x, weight, total, magnitude)).all()
    )


# (M, N, K): K = 32 (one block), 96 / 160 / 544 (3, 5, 17 blocks: tails after groups of 2, 4 and 16), 576 and 1536
# (SmolLM2's widths: 18 and 48 blocks); N = 1, odd and prime; M = 1-9 and 17 (tiles of 8 and a tail)
SHAPES = [
    (1, 1, 32),
    (1, 97, 576),
    (2, 13, 96),
    (3, 31, 160),
    (4, 64, 1536),
    (5, 7, 544),
    (6, 33, 576),
    (7, 19, 64),
    (8, 130, 576),
    (9, 41, 1536),
    (17, 257, 160),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("m,n,k", SHAPES)
def test_matches_twin(build: ctypes.CDLL, fmt: str, dtype: torch.dtype, m: int, n: int, k: int) -> None:
    weight = make_weight(fmt, n, k, seed=m * 1000 + n + k)
    x = make_x(m, k, dtype, seed=n)
    x_before, qs_before = x.clone(), weight.qs.clone()
    got = quant_matmul(x, weight, lib=build)
    assert torch.equal(x, x_before) and torch.equal(weight.qs, qs_before)
    assert_matches_twin(got, x, weight)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_error_against_float64_is_the_activation_quantization(build: ctypes.CDLL, fmt: str, dtype: torch.dtype) -> None:
    """Against x @ W^T in float64 on the exact dequantized weight: each activation moves by at most d_x / 2 plus
    |x| * 2^-22 (the fp32 roundings of 1 / d and x / d), so the error of an output is at most sum_k |w_k| times that,
    plus the fp32 sum's rounding (twin_tolerance) and, for bf16, one rounding of the output."""
    m, n, k = 5, 300, 1536
    weight, x = make_weight(fmt, n, k, seed=11), make_x(m, k, dtype, seed=12)
    got = quant_matmul(x, weight, lib=build).double()
    w64 = dequantize64(weight)
    exact = x.double() @ w64.t()
    _, d, _ = quantize_activations(x)
    step = d.double().repeat_interleave(BLOCK, dim=1) / 2 + x.double().abs() * 2.0**-22  # [M, K]
    total, magnitude = block_products(x, weight)
    bound = step @ w64.abs().t() + twin_tolerance(x, weight, total, magnitude)
    if dtype == torch.bfloat16:
        bound = bound + 2.0**-8 * got.abs()
    assert ((got - exact).abs() <= bound).all()
    # and the int8 activations are a good approximation on the whole: relative RMS error under 2%
    assert (got - exact).norm() < 0.02 * exact.norm()


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_a_rows_bits_do_not_depend_on_the_other_rows_or_the_thread_count(
    build: ctypes.CDLL, fmt: str, dtype: torch.dtype
) -> None:
    weight, x = make_weight(fmt, 1003, 576, seed=5), make_x(17, 576, dtype, seed=6)
    whole = quant_matmul(x, weight, lib=build)  # tiles of 8, 8, 1 over chunks of weight rows
    assert torch.equal(quant_matmul(x[:8], weight, lib=build), whole[:8])
    assert torch.equal(quant_matmul(x[8:11], weight, lib=build), whole[8:11])
    for i in (0, 7, 8, 16):
        assert torch.equal(quant_matmul(x[i : i + 1], weight, lib=build), whole[i : i + 1])
    threads = torch.get_num_threads()
    try:
        for count in (1, 3):
            torch.set_num_threads(count)
            assert torch.equal(quant_matmul(x, weight, lib=build), whole)
            assert torch.equal(quant_matmul(x[:1], weight, lib=build), whole[:1])
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("fmt", FORMATS)
def test_zero_blocks(build: ctypes.CDLL, fmt: str) -> None:
    """Weight blocks with scale 0 (and min 0: a row of them gives exactly 0) and activation blocks of zeros (d = 0,
    q = 0) or too small to scale (amax / 127 under FLT_MIN: taken as zeros, like the twin)."""
    m, n, k = 4, 37, 576
    weight, x = make_weight(fmt, n, k, seed=21), make_x(m, k, torch.float32, seed=22)
    weight.scales[:, 3] = 0
    weight.scales[5] = 0
    if weight.mins is not None:
        weight.mins[5] = 0
    x[:, 32:64] = 0
    x[1] = 0
    x[2] = 0
    x[2, 128:160] = 1e-38 * torch.arange(-16, 16)  # amax / 127 < FLT_MIN: quantized to zeros
    got = quant_matmul(x, weight, lib=build)
    assert_matches_twin(got, x, weight)
    assert (got[:, 5] == 0).all() and (got[1] == 0).all() and (got[2] == 0).all()


def _exact_case(fmt: str, dtype: torch.dtype) -> tuple[torch.Tensor, QuantWeight]:
    """Operands whose products and sums are all exact in fp32: weights at the ends of their range (q8: -128 and 127;
    q4: 0 and 15), power-of-two scales and mins, activations k * 2^-7 with amax 127 * 2^-7 in every block, so
    d_x = 2^-7 and q_x = k exactly, at the ends (-127, 127) too."""
    n, k = 6, 128
    g = torch.Generator().manual_seed(3)
    ends = torch.tensor([-128, 127] if fmt != "q4" else [0, 15])
    q = ends[torch.randint(0, 2, (n, k), generator=g)]
    scales = torch.full((n, k // BLOCK), 2.0**-3).to(torch.float16)
    if fmt == "q4":
        weight = QuantWeight("q4", pack_q4(q), scales, torch.full_like(scales, -1.0))
    else:
        weight = QuantWeight(
            "q8", q.to(torch.int8), scales, torch.full_like(scales, 0.5) if fmt == "q8-affine" else None
        )
    xq = torch.tensor([-127, 127])[torch.randint(0, 2, (3, k), generator=g)]
    xq[:, 1::5] = torch.randint(-127, 128, (3, len(range(1, k, 5))), generator=g)
    return (xq * 2.0**-7).to(dtype), weight


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_extreme_values_are_exact(build: ctypes.CDLL, fmt: str, dtype: torch.dtype) -> None:
    """No int16 saturation in the pairs of vpmaddubsw (128 * 127 * 2 fits), no lost sign of -128, no nibble
    mixed up: with every step exact, the kernel equals float64 (then rounded to x.dtype) bit for bit."""
    x, weight = _exact_case(fmt, dtype)
    exact = x.double() @ dequantize64(weight).t()
    got = quant_matmul(x, weight, lib=build)
    assert torch.equal(got, exact.to(dtype))
    assert torch.equal(quant_matmul_reference(x, weight), exact.to(dtype))


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_strided_rows_of_x_and_y(build: ctypes.CDLL, dtype: torch.dtype) -> None:
    """x rows a stride apart (a narrowing of a wider tensor) through the wrapper; y rows a stride apart through the
    C entry point, the columns between them untouched."""
    m, n, k = 9, 45, 576
    weight = make_weight("q4", n, k, seed=31)
    wide = make_x(m, k + 64, dtype, seed=32)
    x = wide[:, 20 : 20 + k]
    assert x.stride(0) == k + 64
    got = quant_matmul(x, weight, lib=build)
    assert torch.equal(got, quant_matmul(x.contiguous(), weight, lib=build))
    y = torch.full((m, n + 3), 7.0, dtype=dtype)
    status = build.quant_matmul(
        x.data_ptr(),
        x.stride(0),
        weight.qs.data_ptr(),
        weight.scales.data_ptr(),
        weight.mins.data_ptr(),
        0,
        y.data_ptr(),
        n + 3,
        m,
        n,
        k,
        int(dtype == torch.bfloat16),
    )
    assert status == 0 and torch.equal(y[:, :n], got) and (y[:, n:] == 7).all()


def test_bad_arguments_are_refused(build: ctypes.CDLL) -> None:
    weight, x = make_weight("q4", 8, 64, seed=41), make_x(2, 64, torch.float32, seed=42)
    y = torch.empty(2, 8)

    def call(x_ptr=x.data_ptr(), x_stride=64, mins=weight.mins.data_ptr(), fmt=0, m=2, n=8, k=64) -> int:
        return build.quant_matmul(
            x_ptr, x_stride, weight.qs.data_ptr(), weight.scales.data_ptr(), mins, fmt, y.data_ptr(), 8, m, n, k, 0
        )

    assert call() == 0
    for bad in (
        dict(k=48),
        dict(k=0),
        dict(m=0),
        dict(m=-1),
        dict(n=-1),
        dict(x_ptr=None),
        dict(mins=None),
        dict(fmt=2),
        dict(x_stride=32),
    ):
        assert call(**bad) == -1, bad
    assert call(n=0) == 0
    for bad_x in (x[0], x[:, :32], x.half(), x.t().contiguous().t(), x[:0], x[:1].expand(3, 64)):
        with pytest.raises(ValueError):
            quant_matmul(bad_x, weight, lib=build)


def test_the_packages_library_by_default() -> None:
    """The default path: the package's build of the kernels (kernels/cpu_kernels.py), against the twin."""
    weight = make_weight("q4", 200, 576, seed=51)
    if not quant_matmul_takes(weight):
        pytest.skip("no native library")
    for dtype in DTYPES:
        x = make_x(3, 576, dtype, seed=52)
        assert_matches_twin(quant_matmul(x, weight), x, weight)
    narrowed = QuantWeight("q4", weight.qs[:, :144], weight.scales[:, :9], weight.mins[:, :9])
    copied = QuantWeight("q4", *(t.contiguous() for t in narrowed.tensors().values()))
    assert not quant_matmul_takes(narrowed) and quant_matmul_takes(copied)


def test_the_default_path_follows_the_selected_build(
    builds: dict[str, ctypes.CDLL | str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """cpu_kernels._library() is the build of the selected ISA level (the kernel tests swap it): quant_matmul
    without `lib` calls whichever it gives now. The builds sum in different orders, so their bits tell them apart."""
    weight, x = make_weight("q4", 300, 1536, seed=61), make_x(2, 1536, torch.float32, seed=62)
    outputs = {}
    for name, lib in builds.items():
        if isinstance(lib, str):  # the same code paths as build `lib`
            continue
        monkeypatch.setattr(cpu_kernels, "_library", lambda lib=lib: lib)
        outputs[name] = quant_matmul(x, weight)
        assert torch.equal(outputs[name], quant_matmul(x, weight, lib=lib))
    generic = builds["x86-64"] if isinstance(builds["x86-64"], str) else "x86-64"
    assert not torch.equal(outputs["native"], outputs[generic])


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_a_row_holding_nan_or_inf_gives_nan_outputs_and_the_other_rows_their_own(
    build: ctypes.CDLL, fmt: str, dtype: torch.dtype
) -> None:
    """A NaN or an infinity anywhere in a row of x (first, middle or last place of a block, first or last block)
    makes every output of that row NaN, as x W^T's would be non-finite: the engine's non-finite logits check then
    fails the request (a NaN used to be dropped by the block's max and its row came out as finite numbers). The other
    rows keep their bits."""
    m, n, k = 9, 41, 576
    weight, x = make_weight(fmt, n, k, seed=31), make_x(m, k, dtype, seed=32)
    clean = {"kernel": quant_matmul(x, weight, lib=build), "twin": quant_matmul_reference(x, weight)}
    spoiled = {1: (0, math.nan), 3: (300, math.inf), 4: (575, -math.inf), 6: (31, math.nan), 7: (544, math.inf)}
    for row, (col, value) in spoiled.items():
        x[row, col] = value
    kept = [row for row in range(m) if row not in spoiled]
    for name, got in (("kernel", quant_matmul(x, weight, lib=build)), ("twin", quant_matmul_reference(x, weight))):
        assert got[list(spoiled)].isnan().all(), name
        assert torch.equal(got[kept], clean[name][kept]), name
