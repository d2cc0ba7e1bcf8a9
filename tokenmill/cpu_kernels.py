"""The C++ CPU kernels (tokenmill/csrc): paged attention, fused element-wise ops, and the
panel GEMM behind every projection.

Compiled with torch's extension tooling on first use and cached under torch's extension
directory (~/.cache/torch_extensions), so later runs load them in milliseconds. Callers
fall back to plain torch when no compiler is available.
"""

from __future__ import annotations

import functools
import logging
import os
import time
from pathlib import Path

logger = logging.getLogger(__name__)

_CSRC = Path(__file__).resolve().parent / "csrc"
_SOURCES = ["bindings.cpp", "paged_attention_cpu.cpp", "fused_cpu.cpp", "gemm_cpu.cpp", "decoder_layer_cpu.cpp",
            "sampler_cpu.cpp"]


_NAME = "tokenmill_cpu_ops"
STALE_LOCK_SECONDS = 600  # a build takes 2-4 minutes on 2 cores


def _build_directory() -> Path | None:
    """Where torch builds the kernels; None where it cannot be read (a private torch function:
    what uses it is best effort)."""
    try:
        from torch.utils.cpp_extension import _get_build_directory
        return Path(_get_build_directory(_NAME, verbose=False))
    except (ImportError, AttributeError, TypeError, OSError):
        return None


def _clear_stale_lock(build_dir: Path) -> None:
    """torch's build waits, without a word and without end, while another build's lock file
    exists; a first run interrupted mid-build (Ctrl-C) leaves one behind, so every later start
    hung. A lock older than any build is removed; a younger one is announced."""
    lock = build_dir / "lock"
    try:
        age = time.time() - lock.stat().st_mtime
    except OSError:
        return
    if age > STALE_LOCK_SECONDS:
        logger.warning("removing %s, left %d minutes ago by an interrupted kernel build", lock, age // 60)
        lock.unlink(missing_ok=True)
    else:
        logger.warning("waiting for another process's kernel build to finish (or delete %s if none runs)", lock)


def _announce_build(build_dir: Path) -> None:
    """Say so when the kernels are about to compile (minutes of silence otherwise)."""
    built = build_dir / f"{_NAME}.so"
    try:
        newest = max(f.stat().st_mtime for f in _CSRC.iterdir())
        stale = not built.exists() or built.stat().st_mtime < newest
    except OSError:
        return
    if stale:
        logger.warning("compiling tokenmill's CPU kernels (after an install or update; about 2 minutes "
                       "on 2 cores; cached in %s)", build_dir)


@functools.lru_cache(maxsize=1)
def _build():
    from torch.utils.cpp_extension import load
    os.environ.setdefault("MAX_JOBS", str(os.cpu_count() or 1))
    build_dir = _build_directory()
    if build_dir is not None:
        _clear_stale_lock(build_dir)
        _announce_build(build_dir)
    # -fopenmp: at::parallel_for is inlined from ATen's headers and only threads under OpenMP.
    return load(name=_NAME, sources=[str(_CSRC / s) for s in _SOURCES],
                extra_include_paths=[str(_CSRC)], extra_cflags=["-O3", "-march=native", "-fopenmp"],
                extra_ldflags=["-fopenmp"], verbose=False)


def load_cpu_kernels(required: bool):
    """The compiled module, or None when it cannot be built and `required` is False."""
    try:
        return _build()
    except Exception as exc:  # a missing compiler or headers: fall back rather than fail
        if required:
            raise RuntimeError(f"cannot build tokenmill's CPU kernels: {exc}") from exc
        logger.warning("CPU kernels unavailable (%s); using plain torch", exc)
        return None
