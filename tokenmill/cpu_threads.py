"""How many threads a CPU step runs on: the cores this process may use, less those that other
processes are using right now.

Every parallel kernel ends when its slowest thread does. When a neighbour (another process, a
busy host) holds one of the cores, the thread that shares that core runs only part of the time,
and each of a step's few hundred parallel calls waits for it: two threads then do less than one.
So the engine counts the cores the machine's other work took over the last half second and runs
on the rest, back up once they have been free for a while:

    others = (busy time of our CPUs in /proc/stat - this process's own CPU time) / wall time
    threads = clamp(round(cpus - others), 1, limit)

Fewer threads are taken at the first window that asks for them, more only after three windows in
a row ask: too many threads beside a neighbour cost far more (every kernel waits for the thread
that shares its core) than one thread too few on a free core. On two usable CPUs, with the C++
kernels to pin threads, a neighbour gets both threads bound one to a CPU instead of one thread,
and heavy load one thread (ThreadGovernor).

Busy time counts steal (a virtual CPU the host gave to another guest is as unavailable as one
a local process holds); this process's own time, its spinning OpenMP workers included, does not.
Nor does the time of niced processes (niceness above 0) while the engine itself is not niced: the
kernel's scheduler gives a core to the engine's thread at once and leaves such a neighbour the
rest, so the core stays the engine's (a `nice -n 19` prefill instance beside a decode instance,
a background job). A niced engine counts them, as its peers.
`--num-threads N` fixes the count instead.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Callable
from pathlib import Path

logger = logging.getLogger(__name__)

_IDLE_FIELDS = (3, 4)  # idle, iowait in a /proc/stat cpu line's values (after the name)
_NICE_FIELD = 1        # the time of processes with a niceness above 0


def cgroup_cpu_limit(root: Path = Path("/sys/fs/cgroup")) -> float | None:
    """The CPUs' worth of time the cgroup quota allows (cgroup v2 `cpu.max`, v1
    `cpu.cfs_quota_us` / `cpu.cfs_period_us`), or None when there is no quota."""
    try:
        quota, period = (root / "cpu.max").read_text().split()
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    for v1 in (root / "cpu", root / "cpu,cpuacct", root):
        try:
            quota = int((v1 / "cpu.cfs_quota_us").read_text())
            period = int((v1 / "cpu.cfs_period_us").read_text())
        except (OSError, ValueError):
            continue
        return None if quota <= 0 else quota / period
    return None


def usable_cpus(cgroup_root: Path = Path("/sys/fs/cgroup"),
                env: dict[str, str] | None = None) -> tuple[set[int], int]:
    """The CPUs this process may run on (its affinity) and how many threads they allow: their
    count, lowered to the cgroup quota rounded up and to OMP_NUM_THREADS when that is set."""
    cpus = os.sched_getaffinity(0)
    limit = cgroup_cpu_limit(cgroup_root)
    count = len(cpus) if limit is None else max(1, min(len(cpus), math.ceil(limit)))
    omp = (os.environ if env is None else env).get("OMP_NUM_THREADS", "")
    if omp.isdigit() and int(omp) > 0:
        count = min(count, int(omp))
    return cpus, count


def cpus_busy_seconds(cpus: set[int], stat: Path = Path("/proc/stat"), count_nice: bool = True) -> float:
    """Time the given CPUs spent on anything but idling since boot (steal included), in seconds;
    without the time of niced processes unless `count_nice`."""
    free = _IDLE_FIELDS if count_nice else (*_IDLE_FIELDS, _NICE_FIELD)
    ticks = 0
    for line in stat.read_text().splitlines():
        name, _, rest = line.partition(" ")
        if not name.startswith("cpu") or name == "cpu" or int(name[3:]) not in cpus:
            continue
        values = [int(v) for v in rest.split()[:8]]  # user nice system idle iowait irq softirq steal
        ticks += sum(v for i, v in enumerate(values) if i not in free)
    return ticks / os.sysconf("SC_CLK_TCK")


def own_cpu_seconds() -> float:
    """This process's CPU time, all its threads, user and system."""
    t = os.times()
    return t.user + t.system


class ThreadGovernor:
    """Sets the intra-op thread count between steps from the cores other processes leave free
    (module docstring). `update` is called before each step, on the thread that runs it.

    With `bind` (pins the calling thread's OpenMP team: thread t to cpus[t], or every thread to
    all of them) on two usable CPUs, a neighbour gets the two threads bound one to a core rather
    than one thread: a neighbour can then share a core with only one of them, never put both on
    one. Beside one or two busy processes that got ahead of one thread, where two floating threads
    fell behind it (BENCHMARKS.md). Bound threads leave such a neighbour about half a core, so its
    busy time reads lower there: one thread again only past 1.25 CPUs' worth (heavy load), and
    unbound only below a quarter."""

    UP_WINDOWS = 3  # windows in a row that must ask for a more parallel level before it is taken

    def __init__(self, cpus: set[int], limit: int, set_threads: Callable[[int], None], interval: float = 0.5,
                 busy: Callable[[], float] | None = None, own: Callable[[], float] = own_cpu_seconds,
                 clock: Callable[[], float] = time.monotonic,
                 bind: Callable[[list[int], bool], None] | None = None) -> None:
        self.num_cpus = len(cpus)
        self.limit = limit
        self.cpus = sorted(cpus)
        self.set_threads = set_threads
        self.bind = bind if len(cpus) == limit == 2 else None
        # the settings, from the most cautious to the most parallel: (threads, bound one to a CPU)
        self.levels = ([(1, False), (2, True), (2, False)] if self.bind is not None
                       else [(n, False) for n in range(1, limit + 1)])
        self.level = len(self.levels) - 1
        self.interval = interval
        count_nice = os.getpriority(os.PRIO_PROCESS, 0) > 0  # niced neighbours are peers of a niced engine
        self._busy = busy if busy is not None else (lambda: cpus_busy_seconds(cpus, count_nice=count_nice))
        self._own = own
        self._clock = clock
        self._asked_up = 0              # windows in a row that asked for a more parallel level
        self.others = 0.0               # CPUs' worth the other processes used in the last window
        self._apply()
        self._mark = (clock(), self._busy(), own())

    @property
    def threads(self) -> int:
        return self.levels[self.level][0]

    @property
    def bound(self) -> bool:
        return self.levels[self.level][1]

    def update(self) -> None:
        now = self._clock()
        since, busy_then, own_then = self._mark
        if now - since < self.interval:
            return
        busy, own = self._busy(), self._own()
        self._mark = (now, busy, own)
        self.others = max(0.0, (busy - busy_then) - (own - own_then)) / (now - since)
        wanted = self._wanted_level()
        self._asked_up = self._asked_up + 1 if wanted > self.level else 0
        if wanted < self.level or self._asked_up >= self.UP_WINDOWS:
            logger.debug("CPU threads %s -> %s: other processes held %.2f of %d CPUs",
                         self.levels[self.level], self.levels[wanted], self.others, self.num_cpus)
            self.level = wanted
            self._apply()
            self._asked_up = 0

    def reset(self) -> None:
        """Back to the level the governor began at, the most parallel (every thread, none pinned):
        for a caller whose own thread ran the steps and goes on with work of its own (LLM's calls),
        which a level taken under load would otherwise hold to one thread or one core."""
        self.level = len(self.levels) - 1
        self._asked_up = 0
        self._apply()

    def _wanted_level(self) -> int:
        if self.bind is None:  # a thread per CPU the others leave free
            return min(self.limit, max(1, math.floor(self.num_cpus - self.others + 0.5))) - 1
        # Two CPUs, levels 0 (one thread), 1 (two bound), 2 (two unbound). The bound level sees a
        # neighbour at about half its share, so it leaves for one thread only past 1.25 and for
        # unbound only below 0.25; one thread moves up to bound below 1.2 (not 1.25, so that a
        # reading near the line does not flip between the two).
        if self.others >= 1.25:
            return 0
        if self.others >= 0.5:
            return 1 if self.level >= 1 or self.others < 1.2 else 0
        return 2 if self.level == 2 or self.others < 0.25 else 1

    def _apply(self) -> None:
        self.set_threads(self.threads)
        if self.bind is not None:  # after the count: a worker started now takes its starter's CPUs
            self.bind(self.cpus, self.bound)
