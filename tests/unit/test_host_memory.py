"""Host memory: huge-page backed allocations and the memory a process can still take."""

from __future__ import annotations

import gc

import torch

from tokenmill.host_memory import huge_page_zeros, memory_available


def test_huge_page_zeros_is_a_zeroed_aligned_tensor_that_outlives_its_mapping():
    t = huge_page_zeros((3, 5, 1 << 16), torch.float32)
    assert t.shape == (3, 5, 1 << 16) and t.dtype == torch.float32 and t.is_contiguous()
    assert t.data_ptr() % (2 << 20) == 0
    assert not t.any()
    view = t[1]
    del t
    gc.collect()
    view.fill_(2.0)  # the mapping is still alive through the view
    assert view.sum().item() == 2.0 * 5 * (1 << 16)


def test_empty_shape():
    assert huge_page_zeros((0, 4), torch.float32).shape == (0, 4)


def test_huge_page_copies_are_equal_aligned_and_independent():
    from tokenmill.host_memory import huge_page_copies
    src = [torch.randn(3, 5), torch.randn(7), torch.randn(2, 2, 2)]
    copies = huge_page_copies(src)
    for a, b in zip(src, copies):
        assert torch.equal(a, b) and b.data_ptr() % 64 == 0 and b.data_ptr() != a.data_ptr()
    copies[0].zero_()
    assert torch.equal(copies[1], src[1]) and src[0].any()


def test_huge_page_slots_hold_any_dtypes_side_by_side():
    from tokenmill.host_memory import huge_page_copies, huge_page_slots
    src = [torch.randn(5), torch.arange(3, dtype=torch.uint8), torch.randn(4, dtype=torch.float64)]
    copies = huge_page_copies(src)
    assert all(torch.equal(a, b) and a.dtype == b.dtype and b.data_ptr() % 64 == 0 for a, b in zip(src, copies))
    slots = huge_page_slots([100, 1, 64])
    assert [s.numel() for s in slots] == [100, 1, 64]
    assert [s.data_ptr() - slots[0].data_ptr() for s in slots] == [0, 128, 192]


def test_memory_available_is_meminfos_figure_lowered_to_what_the_cgroup_limit_leaves(tmp_path):
    proc, cgroup = tmp_path / "proc", tmp_path / "cgroup"
    proc.mkdir()
    cgroup.mkdir()
    (proc / "meminfo").write_text("MemTotal:       24000000 kB\nMemAvailable:   20000000 kB\n")
    assert memory_available(proc, cgroup) == 20000000 * 1024  # no cgroup files: the machine's figure
    (cgroup / "memory.max").write_text("max\n")
    (cgroup / "memory.current").write_text("1000\n")
    assert memory_available(proc, cgroup) == 20000000 * 1024  # no limit
    (cgroup / "memory.max").write_text(f"{8 << 30}\n")
    (cgroup / "memory.current").write_text(f"{3 << 30}\n")
    assert memory_available(proc, cgroup) == 5 << 30
    (proc / "meminfo").unlink()
    assert memory_available(proc, cgroup) == 5 << 30
    (cgroup / "memory.max").unlink()
    assert memory_available(proc, cgroup) is None
