"""The thread count follows the cores other processes leave free: fed fake clocks and CPU times."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tokenmill.cpu_threads import ThreadGovernor, cgroup_cpu_limit, cpus_busy_seconds, usable_cpus


class FakeHost:
    """A clock, the CPUs' busy seconds and this process's own CPU seconds, advanced by hand."""

    def __init__(self) -> None:
        self.now = self.busy = self.own = 0.0
        self.calls: list[int] = []
        self.binds: list[bool] = []  # one_each of each bind call

    def run(self, seconds: float, own_cores: float, other_cores: float) -> None:
        self.now += seconds
        self.own += own_cores * seconds
        self.busy += (own_cores + other_cores) * seconds

    def governor(self, cpus: int = 2, limit: int = 2, bind: bool = False) -> ThreadGovernor:
        return ThreadGovernor(set(range(cpus)), limit, self.calls.append, interval=0.5, busy=lambda: self.busy,
                              own=lambda: self.own, clock=lambda: self.now,
                              bind=(lambda cpus, one_each: self.binds.append(one_each)) if bind else None)


def windows(host: FakeHost, gov: ThreadGovernor, count: int, own_cores: float, other_cores: float) -> None:
    for _ in range(count):
        host.run(0.5, own_cores, other_cores)
        gov.update()


def test_a_new_governor_sets_its_limit_at_once() -> None:
    host = FakeHost()
    gov = host.governor(cpus=4, limit=3)
    assert gov.threads == 3 and host.calls == [3]


def test_a_neighbour_holding_one_core_of_two_leaves_one_thread_at_the_first_window() -> None:
    host = FakeHost()
    gov = host.governor()
    windows(host, gov, 1, own_cores=1.0, other_cores=1.0)
    assert gov.threads == 1 and gov.others == 1.0 and host.calls == [2, 1]


def test_the_threads_come_back_after_three_free_windows_in_a_row() -> None:
    host = FakeHost()
    gov = host.governor()
    windows(host, gov, 1, own_cores=1.0, other_cores=1.0)
    windows(host, gov, 2, own_cores=1.0, other_cores=0.0)
    assert gov.threads == 1
    windows(host, gov, 1, own_cores=1.0, other_cores=0.0)
    assert gov.threads == 2 and host.calls == [2, 1, 2]


def test_a_busy_window_among_free_ones_starts_the_count_of_free_ones_again() -> None:
    host = FakeHost()
    gov = host.governor()
    for others in (1.0, 0.0, 0.2, 1.0, 0.0, 0.0, 0.9, 0.0, 0.0):  # 0.2: free enough for two threads
        windows(host, gov, 1, own_cores=1.0, other_cores=others)
    assert gov.threads == 1 and host.calls == [2, 1]


def test_the_engine_own_spinning_workers_do_not_count_as_a_neighbour() -> None:
    host = FakeHost()
    gov = host.governor()
    windows(host, gov, 4, own_cores=2.0, other_cores=0.0)
    assert gov.threads == 2 and gov.others == 0.0


def test_less_than_half_a_core_taken_keeps_every_thread_and_more_drops_one() -> None:
    host = FakeHost()
    gov = host.governor(cpus=4, limit=4)
    windows(host, gov, 1, own_cores=3.0, other_cores=0.4)
    assert gov.threads == 4
    windows(host, gov, 1, own_cores=3.0, other_cores=0.6)
    assert gov.threads == 3


def test_never_below_one_thread_nor_above_the_limit() -> None:
    host = FakeHost()
    gov = host.governor(cpus=2, limit=1)
    windows(host, gov, 3, own_cores=0.0, other_cores=5.0)
    assert gov.threads == 1
    windows(host, gov, 3, own_cores=1.0, other_cores=0.0)
    assert gov.threads == 1 and host.calls == [1]


def test_on_two_cpus_a_neighbour_gets_two_threads_bound_one_to_a_cpu() -> None:
    host = FakeHost()
    gov = host.governor(bind=True)
    assert (gov.threads, gov.bound) == (2, False) and host.binds == [False]
    windows(host, gov, 1, own_cores=1.5, other_cores=1.0)
    assert (gov.threads, gov.bound) == (2, True) and host.calls == [2, 2] and host.binds == [False, True]
    windows(host, gov, 5, own_cores=1.5, other_cores=0.5)  # the neighbour now shares a core: stays bound
    assert (gov.threads, gov.bound) == (2, True)
    windows(host, gov, 2, own_cores=2.0, other_cores=0.1)
    assert gov.bound
    windows(host, gov, 1, own_cores=2.0, other_cores=0.1)  # gone three windows in a row: unbound
    assert (gov.threads, gov.bound) == (2, False) and host.binds == [False, True, False]


def test_on_two_cpus_heavy_load_gets_one_thread_and_bound_two_only_after_three_lighter_windows() -> None:
    host = FakeHost()
    gov = host.governor(bind=True)
    windows(host, gov, 1, own_cores=0.5, other_cores=1.6)
    assert (gov.threads, gov.bound) == (1, False)
    windows(host, gov, 3, own_cores=1.0, other_cores=1.22)  # two busy neighbours beside one thread: stay
    assert gov.threads == 1
    windows(host, gov, 2, own_cores=1.0, other_cores=1.0)
    assert gov.threads == 1
    windows(host, gov, 1, own_cores=1.0, other_cores=1.0)
    assert (gov.threads, gov.bound) == (2, True) and host.calls == [2, 1, 2]


def test_reset_gives_back_every_thread_unbound_at_once_and_the_next_load_is_read_afresh() -> None:
    host = FakeHost()
    gov = host.governor(bind=True)
    windows(host, gov, 1, own_cores=1.5, other_cores=1.0)
    assert (gov.threads, gov.bound) == (2, True)
    gov.reset()
    assert (gov.threads, gov.bound) == (2, False) and host.calls == [2, 2, 2] and host.binds == [False, True, False]
    windows(host, gov, 1, own_cores=0.5, other_cores=1.6)
    assert (gov.threads, gov.bound) == (1, False)


def test_binding_is_only_for_two_cpus_all_usable() -> None:
    for cpus, limit in ((4, 4), (2, 1)):
        host = FakeHost()
        gov = host.governor(cpus=cpus, limit=limit, bind=True)
        windows(host, gov, 1, own_cores=1.0, other_cores=1.0)
        assert not gov.bound and host.binds == []


def test_updates_within_the_interval_read_nothing() -> None:
    host = FakeHost()
    reads = []
    gov = ThreadGovernor({0, 1}, 2, host.calls.append, interval=0.5, busy=lambda: reads.append(1) or 0.0,
                         own=lambda: 0.0, clock=lambda: host.now)
    host.now += 0.2
    gov.update()
    assert len(reads) == 1  # the reading taken when it was built


def test_cgroup_v2_quota_gives_cpus_worth_and_max_gives_none(tmp_path: Path) -> None:
    (tmp_path / "cpu.max").write_text("150000 100000\n")
    assert cgroup_cpu_limit(tmp_path) == 1.5
    (tmp_path / "cpu.max").write_text("max 100000\n")
    assert cgroup_cpu_limit(tmp_path) is None


def test_cgroup_v1_quota_is_read_from_the_cpu_controller(tmp_path: Path) -> None:
    (tmp_path / "cpu").mkdir()
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("50000\n")
    (tmp_path / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
    assert cgroup_cpu_limit(tmp_path) == 0.5
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("-1\n")
    assert cgroup_cpu_limit(tmp_path) is None


def test_usable_cpus_are_the_affinity_lowered_to_the_quota_rounded_up(tmp_path: Path) -> None:
    cpus = os.sched_getaffinity(0)
    (tmp_path / "cpu.max").write_text("50000 100000\n")
    assert usable_cpus(tmp_path) == (cpus, 1)
    (tmp_path / "cpu.max").write_text(f"{100000 * (len(cpus) + 3)} 100000\n")
    assert usable_cpus(tmp_path) == (cpus, len(cpus))


def test_omp_num_threads_lowers_the_limit_and_a_bad_value_is_ignored(tmp_path: Path) -> None:
    cpus = os.sched_getaffinity(0)
    assert usable_cpus(tmp_path, env={"OMP_NUM_THREADS": "1"}) == (cpus, 1)
    assert usable_cpus(tmp_path, env={"OMP_NUM_THREADS": "999"}) == (cpus, len(cpus))
    assert usable_cpus(tmp_path, env={"OMP_NUM_THREADS": "two"}) == (cpus, len(cpus))


@contextlib.contextmanager
def busy_process(nice: int = 0) -> Iterator[None]:
    """A Python process spinning for at most 3 s at niceness `nice`, given 0.3 s to start."""
    hog = subprocess.Popen([sys.executable, "-c", f"import os, time\nos.nice({nice})\nend = time.time() + 3\n"
                            "while time.time() < end: pass"])
    try:
        time.sleep(0.3)
        yield
    finally:
        hog.kill()
        hog.wait()


def test_a_busy_process_on_this_machine_shows_in_proc_stat() -> None:
    cpus = os.sched_getaffinity(0)
    with busy_process():
        before, start = cpus_busy_seconds(cpus), time.monotonic()
        time.sleep(0.6)
        busy = (cpus_busy_seconds(cpus) - before) / (time.monotonic() - start)
    assert busy >= 0.7  # the hog's core, at least (other work on the machine only adds)


def test_niced_time_is_left_out_of_busy_time_only_when_asked(tmp_path: Path) -> None:
    stat = tmp_path / "stat"
    hz = os.sysconf("SC_CLK_TCK")
    # user nice system idle iowait irq softirq steal
    stat.write_text(f"cpu  9 9 9 9 9 9 9 9\ncpu0 {hz} {2 * hz} {hz} 500 500 0 0 {hz}\ncpu1 0 {hz} 0 9 9 0 0 0\n")
    assert cpus_busy_seconds({0, 1}, stat) == 6.0
    assert cpus_busy_seconds({0, 1}, stat, count_nice=False) == 3.0
    assert cpus_busy_seconds({1}, stat, count_nice=False) == 0.0


def test_a_niced_busy_process_shows_only_in_the_nice_inclusive_count() -> None:
    cpus = os.sched_getaffinity(0)
    with busy_process(nice=19):
        all_before, unniced_before = cpus_busy_seconds(cpus), cpus_busy_seconds(cpus, count_nice=False)
        time.sleep(0.6)
        niced = (cpus_busy_seconds(cpus) - all_before) - (cpus_busy_seconds(cpus, count_nice=False) - unniced_before)
    assert niced >= 0.4  # the hog's 0.6 s of a core, at least most of it (other niced work only adds)


def test_bind_threads_pins_the_callers_team_one_to_a_cpu_and_unpins_it() -> None:
    """The kernels' bind_threads on this machine's real OpenMP team: with two threads, the caller
    (thread 0) on the first CPU and its worker on the second; then every thread on both again."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        pytest.skip("needs two CPUs")
    import torch

    from tokenmill.cpu_kernels import load_cpu_kernels
    kernels = load_cpu_kernels(required=True)
    threads = torch.get_num_threads()

    def allowed() -> set[str]:  # each thread's Cpus_allowed_list
        lists = set()
        for status in Path("/proc/self/task").glob("*/status"):
            line = next(x for x in status.read_text().splitlines() if x.startswith("Cpus_allowed_list"))
            lists.add(line.split()[-1])
        return lists

    torch.set_num_threads(2)
    try:
        kernels.bind_threads(cpus[:2], True)
        assert os.sched_getaffinity(0) == {cpus[0]}
        assert {str(cpus[0]), str(cpus[1])} <= allowed()
    finally:
        kernels.bind_threads(cpus, False)
        torch.set_num_threads(threads)
    assert os.sched_getaffinity(0) == set(cpus)
