"""Host time of schedule() with a long waiting queue (no model): the step that admits 256 of
4,000 queued requests, and steady steps that admit one each as one running request ends.

    python benchmarks/admission_queue.py
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from fakes import fake_run, make_request, make_scheduler  # noqa: E402

from tokenmill.request import RequestStatus  # noqa: E402


def queued(policy: str, n: int = 4000):
    s = make_scheduler(num_blocks=20000, block_size=16, max_num_seqs=256, budget=1 << 20, max_model_len=4096,
                       policy=policy)
    for i in range(n):
        s.add_request(make_request(f"r{i}", prompt_len=32, max_tokens=100000, arrival=float(i), ignore_eos=True))
    return s


def main() -> None:
    for policy in ("fcfs", "priority"):
        first = []
        for _ in range(3):
            s = queued(policy)
            start = time.perf_counter()
            s.schedule()
            first.append(time.perf_counter() - start)
        s = queued(policy)
        sched = s.schedule()
        s.update(sched, fake_run(sched))
        steady = []
        for _ in range(50):
            s.finish_request(s.running[0].request_id, RequestStatus.FINISHED_ABORTED)
            start = time.perf_counter()
            sched = s.schedule()
            steady.append(time.perf_counter() - start)
            s.update(sched, fake_run(sched))
        print(f"{policy:8s} admitting 256 of 4,000: {min(first) * 1e3:8.1f} ms; one a step with "
              f"{len(s.waiting):,} waiting: median {sorted(steady)[25] * 1e3:6.2f} ms")


if __name__ == "__main__":
    main()
