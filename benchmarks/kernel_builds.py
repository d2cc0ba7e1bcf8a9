"""Builds of the CPU kernels from other checkouts, loadable side by side in one process: the way to
compare two versions of a kernel on this machine, whose speed drifts by tens of percent between
fresh processes a minute apart (alternate the two in one process instead)."""

from __future__ import annotations

import os
import re
import tempfile
from pathlib import Path

from torch.utils.cpp_extension import load


def build_kernels(csrc: str, name: str):
    """A checkout's kernels as module tokenmill_ab_<name>, its classes (DecoderLayer, DecoderStack)
    made module-local so that two builds load side by side. The sources are copied to a fixed place and rewritten only
    when they change, so an unchanged build is not compiled again."""
    src = Path(tempfile.gettempdir()) / "tokenmill_ab_src" / name
    src.mkdir(parents=True, exist_ok=True)
    wanted = {path.name: path for path in Path(csrc).iterdir() if path.suffix in (".cpp", ".h")}
    for stale in src.iterdir():
        if stale.name not in wanted:
            stale.unlink()
    for path in wanted.values():
        text = path.read_text()
        if path.name == "bindings.cpp":
            text, classes = re.subn(r'(py::class_<[^;]*?>\(m, "\w+",)', r"\1 py::module_local(),", text)
            assert classes == text.count("py::class_<"), "bindings.cpp: a py::class_ declared another way"
        if not (src / path.name).exists() or (src / path.name).read_text() != text:
            (src / path.name).write_text(text)
    os.environ.setdefault("MAX_JOBS", str(os.cpu_count() or 1))
    return load(name=f"tokenmill_ab_{name}", sources=[str(s) for s in sorted(src.glob("*.cpp"))],
                extra_include_paths=[str(src)], extra_cflags=["-O3", "-march=native", "-fopenmp"],
                extra_ldflags=["-fopenmp"])


def build_named(specs: list[str]) -> dict:
    """`name=path/to/csrc` arguments -> {name: that checkout's kernels}, in the order given."""
    return {name: build_kernels(path, name) for name, path in (spec.split("=", 1) for spec in specs)}
