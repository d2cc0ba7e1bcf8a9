"""cpu_info: the level read from /proc/cpuinfo's flags, and TOKENMILL_CPU_ISA's limits."""

import subprocess

import pytest

from tokenmill.cpu_info import LEVELS, cpu_info, native_level, parse_cpuinfo

AVX2 = "fpu sse sse2 avx avx2 fma f16c bmi2"
CASCADE_LAKE = AVX2 + " avx512f avx512dq avx512bw avx512vl avx512cd avx512_vnni"
ZEN4 = AVX2 + " avx512f avx512dq avx512bw avx512vl avx512_bf16 avx512_vnni avx512_bitalg"
SAPPHIRE_RAPIDS = ZEN4 + " avx_vnni avx512_fp16 amx_bf16 amx_tile amx_int8"


def cpuinfo(model: str, flags: str) -> str:
    first = f"processor\t: 0\nvendor_id\t: x\nmodel name\t: {model}\nflags\t\t: {flags}\n\n"
    return first + "processor\t: 1\nmodel name\t: other\nflags\t\t: fpu\n"


@pytest.mark.parametrize("flags, level", [("fpu sse sse2 avx", "generic"), (AVX2, "avx2"),
                                          (AVX2 + " avx512f avx512bw avx512vl avx512dq", "avx512"),
                                          (CASCADE_LAKE, "avx512_vnni"), (ZEN4, "avx512_bf16"),
                                          (SAPPHIRE_RAPIDS, "amx"),
                                          (AVX2 + " amx_bf16 amx_tile amx_int8", "avx2")])
def test_the_level_is_the_highest_whose_needs_and_those_below_it_are_all_met(flags, level):
    assert native_level(frozenset(flags.split())) == level


def test_the_first_processors_model_and_flags_are_read():
    model, flags = parse_cpuinfo(cpuinfo("AMD EPYC 9R14", ZEN4))
    assert model == "AMD EPYC 9R14" and flags == frozenset(ZEN4.split())


def test_an_amx_machine_names_its_matrix_flags_and_builds_natively():
    info = cpu_info(cpuinfo=cpuinfo("Intel Xeon Platinum 8488C", SAPPHIRE_RAPIDS))
    assert info.level == info.native_level == "amx"
    assert info.reported_flags == ["amx_bf16", "amx_int8", "avx512_bf16", "avx512_vnni", "avx_vnni", "avx512f", "avx2"]
    assert info.compile_flags == ["-march=native"]
    assert info.as_dict() == {"model": "Intel Xeon Platinum 8488C", "flags": info.reported_flags,
                              "native_level": "amx", "level": "amx"}


def test_a_forced_level_holds_the_build_below_the_cpus_own():
    info = cpu_info(cpuinfo=cpuinfo("Intel Xeon", SAPPHIRE_RAPIDS), forced="avx2")
    assert (info.native_level, info.level) == ("amx", "avx2")
    assert info.compile_flags == ["-march=native", "-mno-avx512f", "-mno-avxvnni", "-mno-amx-tile",
                                  "-mno-amx-bf16", "-mno-amx-int8"]
    assert info.has("avx2") and not info.has("avx512")
    assert "held below this CPU's amx by TOKENMILL_CPU_ISA" in info.describe()
    assert cpu_info(cpuinfo=cpuinfo("x", SAPPHIRE_RAPIDS), forced="native").level == "amx"


@pytest.mark.parametrize("forced, message", [("avx512", "supports up to avx2"), ("sse9", "must be one of")])
def test_a_level_above_the_cpu_or_unknown_is_a_value_error(forced, message):
    with pytest.raises(ValueError, match=message):
        cpu_info(cpuinfo=cpuinfo("AMD EPYC", AVX2), forced=forced)


@pytest.mark.parametrize("level", LEVELS[1:-1])
def test_gcc_takes_each_levels_flags_and_then_defines_nothing_above_it(level):
    """The flags that hold a build to a level leave no macro of a higher instruction set set."""
    info = cpu_info(cpuinfo=cpuinfo("x", SAPPHIRE_RAPIDS), forced=level)
    flags = [f.replace("-march=native", "-march=sapphirerapids") for f in info.compile_flags]
    macros = subprocess.run(["gcc", *flags, "-E", "-dM", "-x", "c", "/dev/null"], capture_output=True,
                            text=True, check=True).stdout
    above = {"avx2": ["__AVX512F__", "__AVX512VL__", "__AVX512BF16__", "__AVXVNNI__", "__AMX_TILE__", "__AMX_BF16__"],
             "avx512": ["__AVX512BF16__", "__AVX512VNNI__", "__AMX_TILE__", "__AMX_INT8__"],
             "avx512_vnni": ["__AVX512BF16__", "__AVX512VBMI__", "__AMX_TILE__", "__AMX_INT8__"],
             "avx512_bf16": ["__AMX_TILE__", "__AMX_BF16__", "__AMX_INT8__"]}[level]
    assert "#define __AVX2__" in macros
    assert [m for m in above if f"#define {m} " in macros] == []
