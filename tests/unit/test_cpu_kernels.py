"""cpu_kernels: the build's cache key, its announcement, a lock left by an interrupted build, and
what the build multiplies."""

import shutil
import subprocess
import sys
import threading

import pytest

from tokenmill import cpu_kernels
from tokenmill.cpu_info import cpu_info

FLAGS = "model name\t: x\nflags\t\t: avx avx2 fma f16c avx512f avx512dq avx512bw avx512vl\n"


def test_the_cache_key_follows_the_sources_content_not_their_path(tmp_path):
    """Two checkouts of one version share a build; a changed source gets a build of its own."""
    cpu = cpu_info(cpuinfo=FLAGS)
    one, two = tmp_path / "one", tmp_path / "two"
    shutil.copytree(cpu_kernels._CSRC, one)
    shutil.copytree(cpu_kernels._CSRC, two)
    assert cpu_kernels.build_name(cpu, one) == cpu_kernels.build_name(cpu, two) == cpu_kernels.build_name(cpu)
    with open(two / "gemm_cpu.cpp", "a") as f:
        f.write("// another version\n")
    assert cpu_kernels.build_name(cpu, one) != cpu_kernels.build_name(cpu, two)


def test_two_environments_with_the_same_torch_keep_a_build_each(monkeypatch):
    """torch rebuilds when its include paths change: two venvs sharing one build would rebuild
    it for each other at every start."""
    import torch
    cpu = cpu_info(cpuinfo=FLAGS)
    here = cpu_kernels.build_name(cpu)
    monkeypatch.setattr(torch, "__file__", "/elsewhere/venv/lib/python3.11/site-packages/torch/__init__.py")
    assert cpu_kernels.build_name(cpu) != here


def test_the_cache_key_follows_the_level_and_the_cpus_flags():
    """A build copied to another CPU, or held to another level, is never loaded in its place."""
    avx512 = cpu_info(cpuinfo=FLAGS)
    avx2 = cpu_info(cpuinfo=FLAGS, forced="avx2")
    other_cpu = cpu_info(cpuinfo=FLAGS.replace("avx2", "avx2 vaes"))
    names = {cpu_kernels.build_name(c) for c in (avx512, avx2, other_cpu)}
    assert len(names) == 3
    assert cpu_kernels.build_name(avx512).startswith("tokenmill_cpu_ops_avx512_")
    assert cpu_kernels.build_name(avx2).startswith("tokenmill_cpu_ops_avx2_")


def test_a_build_is_announced_exactly_when_its_library_is_missing(monkeypatch, tmp_path, caplog):
    """Compiling takes minutes on a fresh install: say so then, and only then."""
    import torch.utils.cpp_extension as extension
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    loaded = []
    monkeypatch.setattr(extension, "load", lambda **options: loaded.append(options) or "module")
    cpu_kernels._build.cache_clear()
    try:
        with caplog.at_level("WARNING", logger="tokenmill.cpu_kernels"):
            assert cpu_kernels._build() == "module"
            assert "compiling tokenmill's CPU kernels" in caplog.text
            name = loaded[0]["name"]
            staged = tmp_path / name / "src"
            assert loaded[0]["sources"][0] == str(staged / "bindings.cpp") and (staged / "gemm_cpu.cpp").exists()
            assert "-march=native" in loaded[0]["extra_cflags"]
            caplog.clear()
            (tmp_path / name / f"{name}.so").touch()
            cpu_kernels._build.cache_clear()
            cpu_kernels._build()
            assert "compiling" not in caplog.text
    finally:
        cpu_kernels._build.cache_clear()


def test_an_unknown_or_too_high_isa_is_an_error_even_when_kernels_are_optional(monkeypatch):
    monkeypatch.setenv("TOKENMILL_CPU_ISA", "sse9")
    cpu_kernels.this_cpu.cache_clear()
    try:
        with pytest.raises(ValueError, match="TOKENMILL_CPU_ISA must be one of"):
            cpu_kernels.load_cpu_kernels(required=False)
    finally:
        cpu_kernels.this_cpu.cache_clear()


def test_a_killed_builds_lock_is_cleared_at_once_and_a_live_build_waited_for(tmp_path):
    """A build killed mid-way leaves torch's lock file, on which every later start would wait
    forever: the next build takes it away as soon as the killed one's own lock is gone, and waits
    while a live one holds it. The holder here is a real process, killed with SIGKILL."""
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "holding"
        entered = threading.Event()

        def build() -> None:
            with cpu_kernels._builder_lock(tmp_path):
                entered.set()

        waiter = threading.Thread(target=build, daemon=True)
        waiter.start()
        assert not entered.wait(1.0)                     # a live build: wait for it
        assert (tmp_path / "lock").exists()
        holder.kill()
        assert entered.wait(10.0)                        # killed: in at once, its torch lock gone
        waiter.join(10.0)
        assert not (tmp_path / "lock").exists()
    finally:
        holder.kill()
        holder.wait()


# a build in another process: our lock held, torch's lock file made, then nothing until killed
HOLDER = """
import fcntl, pathlib, sys, time
d = pathlib.Path(sys.argv[1])
held = open(d / "builder.lock", "a")
fcntl.flock(held, fcntl.LOCK_EX)
(d / "lock").touch()
print("holding", flush=True)
time.sleep(60)
"""


def test_the_kernels_multiply_bfloat16_panels_exactly_where_their_level_has_avx512_bf16():
    """The build's level decides (TOKENMILL_CPU_ISA=avx512 on this CPU builds without them): the
    loader's default takes bfloat16 weights only from kernels that have the instructions, and the
    kernels multiply on AMX tiles exactly where their level is amx."""
    from tokenmill.cpu_kernels import load_cpu_kernels, this_cpu
    from tokenmill.models.cpu_packing import bf16_weights_by_cpu
    kernels = load_cpu_kernels(required=True)
    assert kernels.bf16 == this_cpu().has("avx512_bf16") == bf16_weights_by_cpu(kernels)
    assert (kernels.amx_min_rows > 0) == this_cpu().has("amx")  # AMX tiles for the bf16 panels' big steps


def test_one_and_two_row_products_stream_their_weights_non_temporally_exactly_on_an_amd_cpu():
    """prefetchnta sped them up on a Zen 4 and slowed them down on a Cascade Lake (gemm_cpu.cpp)."""
    from pathlib import Path

    from tokenmill.cpu_kernels import load_cpu_kernels
    vendor = next(line.split(":")[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("vendor_id"))
    assert load_cpu_kernels(required=True).streams_weights_non_temporally() == (vendor == "AuthenticAMD")
