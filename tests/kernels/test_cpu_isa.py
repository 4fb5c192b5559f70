"""Which build of the native CPU kernels runs (kernels/cpu_kernels.py): the best level the CPU's flags allow, or
the one INFER_CPU_ISA names, refused where the CPU cannot run it; each level's build has the paths it should."""

from __future__ import annotations

import pytest

from infer.kernels import cpu_kernels

ZEN3 = "flags : fpu sse sse2 ssse3 fma cx16 sse4_1 sse4_2 movbe popcnt aes xsave avx f16c abm bmi1 avx2 bmi2 sha_ni"
ZEN5 = ZEN3 + " avx512f avx512dq avx512bw avx512vl avx512_bf16 avx512_vnni"
OLD = "flags : fpu sse sse2 ssse3 cx16 sse4_1 sse4_2 popcnt"
BARE = "flags : fpu sse sse2"


@pytest.fixture
def x86(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpu_kernels, "_is_x86", lambda: True)


@pytest.mark.usefixtures("x86")
@pytest.mark.parametrize(
    "flags, levels",
    [(ZEN5, ("avx512", "avx2", "generic")), (ZEN3, ("avx2", "generic")), (OLD, ("generic",)), (BARE, ("generic",))],
    ids=["zen5", "zen3", "v2", "v1"],
)
def test_the_levels_a_cpu_runs_follow_its_flags(flags: str, levels: tuple[str, ...]) -> None:
    assert cpu_kernels.supported_isas(flags) == levels


@pytest.mark.usefixtures("x86")
def test_the_default_is_the_best_level_and_a_forced_one_must_be_runnable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpu_kernels, "_cpu_flags", lambda: ZEN3)
    assert cpu_kernels.selected_isa({}) == "avx2"
    assert cpu_kernels.selected_isa({"INFER_CPU_ISA": " generic "}) == "generic"
    with pytest.raises(ValueError, match=r"INFER_CPU_ISA='avx512': this CPU cannot run .*avx512bw.*runs avx2, generic"):
        cpu_kernels.selected_isa({"INFER_CPU_ISA": "avx512"})
    with pytest.raises(ValueError, match="no level of the CPU kernels: one of avx512, avx2, generic"):
        cpu_kernels.selected_isa({"INFER_CPU_ISA": "sse9"})
    assert cpu_kernels.isas_at_or_below("avx2") == ("avx2", "generic")
    with pytest.raises(ValueError, match="cannot run the avx512 build"):
        cpu_kernels.library("avx512")
    monkeypatch.setattr(cpu_kernels, "_cpu_flags", lambda: BARE)
    assert cpu_kernels._march("generic") == "-march=x86-64"  # older than x86-64-v2


def test_each_level_is_its_own_build_and_marches_as_named(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """One library per level, under its own name in the cache (a shared home serves every level and CPU)."""
    monkeypatch.setenv("INFER_COMPILE_CACHE", str(tmp_path))
    compiler = cpu_kernels._compiler()
    if compiler is None:
        pytest.skip("no C compiler")
    here = cpu_kernels.supported_isas()
    paths = {isa: cpu_kernels._library_path(compiler, isa) for isa in here}
    assert len(set(paths.values())) == len(here) and all(f"infer_cpu-{isa}-" in p.name for isa, p in paths.items())
    if cpu_kernels._is_x86():
        assert [cpu_kernels._march(isa) for isa in here if isa != "generic"] == [
            {"avx512": "-march=native", "avx2": "-march=x86-64-v3"}[isa] for isa in here if isa != "generic"
        ]
