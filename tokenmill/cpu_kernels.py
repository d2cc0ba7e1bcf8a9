"""The C++ CPU kernels (tokenmill/csrc): paged attention, fused element-wise ops, and the
panel GEMM behind every projection.

Compiled with torch's extension tooling on first use, with -march=native held to the
instruction-set level cpu_info.py names. Each build is cached in a directory of its own under
torch's extension directory (~/.cache/torch_extensions), named by the level and a hash of what
decides the binary: the sources, the compiler flags, the CPU's flags and torch's version. So two
installs of different versions keep a build each instead of rebuilding over one another, a cache
copied to another CPU is never loaded there, and a build is announced exactly when one will run.
The sources are copied into that directory and compiled from there, so identical sources in
two checkouts share one build. Callers fall back to plain torch when no compiler is available.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import logging
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

from tokenmill.cpu_info import ISA_ENV, CpuInfo, cpu_info

logger = logging.getLogger(__name__)

_CSRC = Path(__file__).resolve().parent / "csrc"
_SOURCES = ["bindings.cpp", "paged_attention_cpu.cpp", "fused_cpu.cpp", "gemm_cpu.cpp", "decoder_layer_cpu.cpp",
            "sampler_cpu.cpp", "moe_cpu.cpp"]

_NAME = "tokenmill_cpu_ops"


@functools.lru_cache(maxsize=1)
def this_cpu() -> CpuInfo:
    """This machine's CPU, its kernels held to TOKENMILL_CPU_ISA where that is set; logged once."""
    info = cpu_info(os.environ.get(ISA_ENV))
    logger.info("CPU: %s", info.describe())
    return info


def compile_flags(cpu: CpuInfo) -> list[str]:
    # -fopenmp: at::parallel_for is inlined from ATen's headers and only threads under OpenMP.
    return ["-O3", *cpu.compile_flags, "-fopenmp"]


def build_name(cpu: CpuInfo, csrc: Path = _CSRC) -> str:
    """The build's name: the level and a hash of the files in `csrc`, the flags, the CPU's flags,
    torch's version and where torch is installed (see the module docstring): torch rebuilds when
    the include paths it passes change, so two environments with the same torch would otherwise
    rebuild each other's kernels at every start."""
    import torch
    digest = hashlib.sha256()
    for path in sorted(csrc.iterdir()):
        if path.suffix in (".cpp", ".h"):
            digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    for part in (compile_flags(cpu), sorted(cpu.flags), [torch.__version__, str(Path(torch.__file__).parent)]):
        digest.update(" ".join(part).encode() + b"\0")
    return f"{_NAME}_{cpu.level}_{digest.hexdigest()[:16]}"


def _build_directory(name: str) -> Path | None:
    """Where torch builds `name`; None where it cannot be read (a private torch function: what
    uses it is best effort)."""
    try:
        from torch.utils.cpp_extension import _get_build_directory
        return Path(_get_build_directory(name, verbose=False))
    except (ImportError, AttributeError, TypeError, OSError):
        return None


@contextlib.contextmanager
def _builder_lock(build_dir: Path) -> Iterator[None]:
    """Held while this process builds or loads the kernels in build_dir: an flock on a file there,
    which the operating system releases when its holder exits, however it exits. torch's own lock
    file, which torch waits on without a word and without end while it exists, is left behind by a
    build that was interrupted (Ctrl-C, a killed server); under this lock no other process of ours
    is building, so such a file is stale and is removed."""
    with open(build_dir / "builder.lock", "a") as held:
        try:
            fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            logger.warning("waiting for another process's kernel build in %s to finish", build_dir)
            fcntl.flock(held, fcntl.LOCK_EX)
        stale = build_dir / "lock"
        if stale.exists():
            logger.warning("removing %s, left by an interrupted kernel build", stale)
            stale.unlink(missing_ok=True)
        try:
            yield
        finally:
            fcntl.flock(held, fcntl.LOCK_UN)


def _stage_sources(build_dir: Path) -> list[str]:
    """Copy the sources into build_dir/src (once: the directory's name is their hash) and return
    the paths to compile, the same for every checkout with these sources."""
    src = build_dir / "src"
    if not src.is_dir():
        staging = build_dir / f"src.{os.getpid()}"
        shutil.copytree(_CSRC, staging, ignore=shutil.ignore_patterns("__pycache__"), dirs_exist_ok=True)
        try:
            staging.rename(src)
        except OSError:  # another process staged them first
            shutil.rmtree(staging, ignore_errors=True)
    return [str(src / s) for s in _SOURCES]


@functools.lru_cache(maxsize=1)
def _build():
    from torch.utils.cpp_extension import load
    cpu = this_cpu()
    if not cpu.has("avx2"):
        raise RuntimeError(f"the kernels need AVX2, FMA and F16C, and the build is held to {cpu.level}"
                           if cpu.native_level != "generic" else "the kernels need AVX2, FMA and F16C")
    os.environ.setdefault("MAX_JOBS", str(os.cpu_count() or 1))
    name = build_name(cpu)
    build_dir = _build_directory(name)
    build = functools.partial(load, name=name, extra_cflags=compile_flags(cpu), extra_ldflags=["-fopenmp"],
                              verbose=False)
    if build_dir is None:
        return build(sources=[str(_CSRC / s) for s in _SOURCES])
    build_dir.mkdir(parents=True, exist_ok=True)
    with _builder_lock(build_dir):
        sources = _stage_sources(build_dir)
        if not (build_dir / f"{name}.so").exists():
            logger.warning("compiling tokenmill's CPU kernels for %s (about a minute on 2 cores, once per "
                           "version and CPU; cached in %s)", cpu.level, build_dir)
        return build(sources=sources)


def load_cpu_kernels(required: bool):
    """The compiled module, or None when it cannot be built and `required` is False. A
    TOKENMILL_CPU_ISA that names no level, or one above this CPU's, is a ValueError either way."""
    this_cpu()
    try:
        return _build()
    except Exception as exc:  # a missing compiler or headers, or no AVX2: fall back rather than fail
        if required:
            raise RuntimeError(f"cannot build tokenmill's CPU kernels: {exc}") from exc
        logger.warning("CPU kernels unavailable (%s); using plain torch", exc)
        return None
