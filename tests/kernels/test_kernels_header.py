"""kernels/cpu/kernels.h declares every entry point of the CPU kernels once: each .c file includes it (so the compiler
checks each definition against it), no .c file declares a prototype of its own, and the ctypes bindings are read
from it (cpu_kernels.entry_points) and match the library that is built."""

from __future__ import annotations

import ctypes
import re

import pytest

from infer.kernels import cpu_kernels

CPU_DIR = cpu_kernels.KERNELS_H.parent
DEFINITION = re.compile(r"^(?:int|void) ([a-z_0-9]+)\(([^)]*)\)\s*\{", re.M)
PROTOTYPE = re.compile(r"^(?:int|void) ([a-z_0-9]+)\(([^)]*)\);", re.M)


def _definitions() -> dict[str, tuple[str, str]]:
    """Every non-static function defined in the folder's .c files: name -> (file, its parameters, normalized)."""
    found: dict[str, tuple[str, str]] = {}
    for source in sorted(CPU_DIR.glob("*.c")):
        for name, params in DEFINITION.findall(source.read_text()):
            assert name not in found, f"{name} is defined in {found[name][0]} and {source.name}"
            found[name] = (source.name, " ".join(params.split()))
    return found


def test_every_source_includes_the_header_and_declares_nothing_itself():
    for source in sorted(CPU_DIR.glob("*.c")):
        text = source.read_text()
        assert '#include "kernels.h"' in text, source.name
        assert not PROTOTYPE.findall(text), f"{source.name} declares {PROTOTYPE.findall(text)}: declare it in kernels.h"


def test_the_header_declares_exactly_the_defined_functions_with_their_parameters():
    header = cpu_kernels.KERNELS_H.read_text()
    declared = {name: " ".join(params.split()) for name, params in PROTOTYPE.findall(header)}
    defined = _definitions()
    assert set(declared) == set(defined)
    for name, (source, params) in defined.items():
        assert declared[name] == params, f"{name}: kernels.h says ({declared[name]}), {source} ({params})"


def test_the_bindings_are_read_from_the_header():
    points = cpu_kernels.entry_points()
    assert "attend_rows" not in points  # internal: not bound
    assert set(points) >= {"paged_decode", "paged_prefill", "quant_matmul", "decode_layers", "gemv_paths", "lora_rows"}
    assert points["gemv_paths"] == []
    assert len(points["paged_decode"]) == 20 and points["paged_decode"][15] is ctypes.c_float  # scale
    assert points["row_max"] == [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p,
                                 ctypes.c_void_p]  # fmt: skip


def test_the_built_library_has_every_entry_point_declared_as_the_header_says():
    lib = cpu_kernels._library()
    if lib is None:
        pytest.skip("no native CPU kernels on this machine (no compiler, or INFER_CPU_KERNELS=0)")
    for name, types in cpu_kernels.entry_points().items():
        fn = getattr(lib, name)
        assert fn.argtypes == types and fn.restype is ctypes.c_int, name
