"""What this CPU offers the kernels: its model, its matrix-related instruction sets, and the
instruction-set level the C++ kernels are built for.

The kernels are compiled with -march=native on the machine that runs them. A level names what
that build may use, lowest to highest:

    generic      no AVX2: the kernels are not built (plain torch runs every op)
    avx2         AVX2, FMA, F16C (x86-64-v3): the float32 tiles
    avx512       + AVX-512 F/BW/VL/DQ: 32 vector registers, wide tiles for small steps
    avx512_vnni  + AVX512-VNNI (Cascade Lake, Ice Lake): the 512-bit 8-bit tiles; held to this
                 level, a build leaves VBMI out too, as Cascade Lake has none
    avx512_bf16  + AVX512-BF16 (Zen 4, Cooper Lake and later)
    amx          + AMX tiles with BF16 and INT8 (Xeon 4th generation and later)

TOKENMILL_CPU_ISA=<level> holds a build to a lower level than the CPU's own (compiler flags that
switch the higher instruction sets off), so a machine with AMX can run and test the lower paths.
The kernels' build cache is keyed by the level and the CPU's flags (cpu_kernels.py), so a cache
copied to another machine is never loaded on a CPU it was not built for.
"""

from __future__ import annotations

import dataclasses
import platform
from pathlib import Path

LEVELS = ("generic", "avx2", "avx512", "avx512_vnni", "avx512_bf16", "amx")

# What each level needs in /proc/cpuinfo's flags, beyond the level below it.
_LEVEL_NEEDS = {
    "avx2": ("avx2", "fma", "f16c"),
    "avx512": ("avx512f", "avx512bw", "avx512vl", "avx512dq"),
    "avx512_vnni": ("avx512_vnni",),
    "avx512_bf16": ("avx512_bf16",),
    "amx": ("amx_tile", "amx_bf16", "amx_int8"),
}

# gcc flags, after -march=native, that keep a build at a level (-mno-avx512f switches off every
# AVX-512 subset; AMX's three need naming one by one).
_NO_AMX = ("-mno-amx-tile", "-mno-amx-bf16", "-mno-amx-int8")
_LEVEL_LIMITS = {
    "generic": ("-mno-avx2",),
    "avx2": ("-mno-avx512f", "-mno-avxvnni", *_NO_AMX),
    "avx512": ("-mno-avx512bf16", "-mno-avx512vnni", "-mno-avxvnni", *_NO_AMX),
    "avx512_vnni": ("-mno-avx512bf16", "-mno-avx512vbmi", *_NO_AMX),
    "avx512_bf16": _NO_AMX,
    "amx": (),
}

# The flags worth naming in logs and benchmark output (matrix engines and vector widths).
REPORTED_FLAGS = ("amx_bf16", "amx_int8", "avx512_bf16", "avx512_vnni", "avx_vnni", "avx512f", "avx2")

ISA_ENV = "TOKENMILL_CPU_ISA"


@dataclasses.dataclass(frozen=True)
class CpuInfo:
    model: str                   # "AMD EPYC 9R14", as /proc/cpuinfo names it
    flags: frozenset[str]        # every flag /proc/cpuinfo lists for the first CPU
    native_level: str            # the highest of LEVELS this CPU supports
    level: str                   # the level the kernels are built for: native_level unless forced lower

    @property
    def reported_flags(self) -> list[str]:
        """REPORTED_FLAGS this CPU has, in that order."""
        return [f for f in REPORTED_FLAGS if f in self.flags]

    @property
    def compile_flags(self) -> list[str]:
        """gcc flags for a build at `level` on this machine."""
        return ["-march=native", *(_LEVEL_LIMITS[self.level] if self.level != self.native_level else ())]

    def has(self, level: str) -> bool:
        """Whether the kernels' level is `level` or above."""
        return LEVELS.index(self.level) >= LEVELS.index(level)

    def describe(self) -> str:
        forced = f" (held below this CPU's {self.native_level} by {ISA_ENV})" if self.level != self.native_level else ""
        return (f"{self.model}; {' '.join(self.reported_flags) or 'no AVX2'}; kernels for {self.level}{forced}")

    def as_dict(self) -> dict:
        return {"model": self.model, "flags": self.reported_flags, "native_level": self.native_level,
                "level": self.level}


def native_level(flags: frozenset[str]) -> str:
    """The highest level whose needs (and those of every level below) are all in `flags`."""
    level = "generic"
    for name in LEVELS[1:]:
        if not set(_LEVEL_NEEDS[name]) <= flags:
            break
        level = name
    return level


def parse_cpuinfo(text: str) -> tuple[str, frozenset[str]]:
    """(model name, flags) of the first processor in /proc/cpuinfo's text."""
    model, flags = "", ""
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "model name" and not model:
            model = value.strip()
        elif key == "flags" and not flags:
            flags = value
        if model and flags:
            break
    return model or platform.processor() or "unknown CPU", frozenset(flags.split())


def cpu_info(forced: str | None = None, cpuinfo: str | None = None) -> CpuInfo:
    """This CPU (or the one `cpuinfo` text describes), its kernels held to `forced` when given
    (TOKENMILL_CPU_ISA's value). ValueError for a level unknown or above what the CPU has."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:  # not Linux: no flags read, so no kernels built
            cpuinfo = ""
    model, flags = parse_cpuinfo(cpuinfo)
    native = native_level(flags)
    level = native if forced in (None, "", "native") else forced
    if level not in LEVELS:
        raise ValueError(f"{ISA_ENV} must be one of {', '.join(LEVELS)} or native, got {forced!r}")
    if LEVELS.index(level) > LEVELS.index(native):
        raise ValueError(f"{ISA_ENV}={forced} asks for more than this CPU has: {model} supports up to {native}")
    return CpuInfo(model=model, flags=flags, native_level=native, level=level)
