"""The CPU an idle `tokenmill serve --kv-connector nixl` takes: its NIXL agent's progress thread
is all that runs while no request comes (issue 29).

    python benchmarks/nixl_idle_cpu.py [--checkout DIR] [--kv-role decode] [--seconds 5] [--model PATH]

Starts the instance (one thread, the default model unless --model) from the sources of `--checkout`
(default: this tree), waits until /health answers and 2 s more, then reads its user + system
time from /proc/PID/stat over `--seconds`: the share of a core it took.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

HERE = Path(__file__).resolve().parent.parent


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkout", type=Path, default=HERE)
    parser.add_argument("--kv-role", default="decode", choices=("prefill", "decode", "both"))
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--model", default=None)
    args = parser.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    from tokenmill.models.loader import default_model_path
    model = args.model or str(default_model_path())
    command = [sys.executable, "-m", "tokenmill.cli", "--log-level", "WARNING", "serve", model, "--port", str(port),
               "--kv-role", args.kv_role, "--kv-connector", "nixl", "--num-threads", "1"]
    proc = subprocess.Popen(command, cwd=args.checkout, env={**os.environ, "PYTHONPATH": str(args.checkout)},
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 600
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, "the instance did not start"
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        time.sleep(2.0)
        before, start = cpu_seconds(proc.pid), time.monotonic()
        time.sleep(args.seconds)
        share = (cpu_seconds(proc.pid) - before) / (time.monotonic() - start)
        print(f"{args.checkout.name}: an idle --kv-role {args.kv_role} instance took {share:.1%} of a core "
              f"over {args.seconds:g} s (load average {os.getloadavg()[0]:.1f})")
    finally:
        proc.terminate()
        proc.wait(30)


if __name__ == "__main__":
    main()
