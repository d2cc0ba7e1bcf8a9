"""NIXL KV transfer between two processes on loopback: how long a decode instance's read of a
prompt's blocks takes, as the NIXL connector (tokenmill/kv_nixl.py) does it at admission.

    python benchmarks/nixl_transfer.py [--tls default,tcp,cma] [--blocks 1,8,32,128] [--rounds 20]

For each UCX transport list (UCX_TLS; "default" leaves UCX to choose) a prefill process is
started with a pool of the default model's shape (SmolLM2-135M: 30 layers, 3 KV heads of 64,
blocks of 16 tokens, float32: 720 KiB a block, in 60 regions of 12 KiB) filled with known values,
serving its agent's metadata on a side channel. This process, the decode side, fetches it once,
then reads N blocks at random places of the remote pool into random places of its own, one
transfer each (with the completion notification the connector sends), `rounds` times per N, and
checks the last read's bytes. Prints the median and p90 latency of one transfer, per block, and
the rate. The first transfer to a peer (connection set-up) is timed apart.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the checkout this runs in
from tokenmill.host_memory import huge_page_zeros  # noqa: E402
from tokenmill.kv_nixl import NixlConnector  # noqa: E402

LAYERS, KV_HEADS, HEAD_DIM, BLOCK = 30, 3, 64, 16  # SmolLM2-135M
FINGERPRINT = "bench"


def make_pool(num_blocks: int, fill: bool) -> torch.Tensor:
    """(layers, 2, blocks + 1, kv_heads, block_size, head_dim), as the worker's; filled so that
    every value names its place, or zeros."""
    pool = huge_page_zeros((LAYERS, 2, num_blocks + 1, KV_HEADS, BLOCK, HEAD_DIM), torch.float32)
    if fill:
        pool.copy_(torch.arange(pool.numel(), dtype=torch.float32).view(pool.shape))
    return pool


def serve(num_blocks: int) -> None:
    """The prefill side: a connector over a filled pool; prints its port, lives until stdin closes."""
    connector = NixlConnector("prefill", SimpleNamespace(kv_cache=make_pool(num_blocks, True)), BLOCK, FINGERPRINT,
                              "127.0.0.1", 0, 3600.0, 30.0)
    print(f"port {connector.port} engine {connector.engine_id}", flush=True)
    sys.stdin.read()
    connector.close()


def measure(tls: str, sizes: list[int], rounds: int, num_blocks: int) -> list[str]:
    env = dict(os.environ)
    if tls != "default":
        env["UCX_TLS"] = tls
    os.environ.update(env)  # this side's agent is made below, after UCX_TLS is set
    peer = subprocess.Popen([sys.executable, __file__, "--serve", "--pool-blocks", str(num_blocks)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
    try:
        line = next(line for line in peer.stdout if line.startswith("port "))  # (NIXL logs on stdout too)
        _, port, _, engine_id = line.split()
        pool = make_pool(num_blocks, False)
        connector = NixlConnector("decode", SimpleNamespace(kv_cache=pool), BLOCK, FINGERPRINT, "127.0.0.1", 0,
                                  3600.0, 30.0)
        remote = connector._remote(engine_id, "127.0.0.1", int(port))
        rng = random.Random(0)
        start = time.perf_counter()
        connector._read(remote, [0], [0], b"warm-up")
        lines = [f"{tls:>8}  first transfer (connection set-up): {1e3 * (time.perf_counter() - start):.1f} ms"]
        source = make_pool(num_blocks, True)  # what the remote pool holds, to check against
        for n in sizes:
            times = []
            for _ in range(rounds):
                remote_ids, local_ids = rng.sample(range(num_blocks), n), rng.sample(range(num_blocks), n)
                start = time.perf_counter()
                connector._read(remote, remote_ids, local_ids, b"bench")
                times.append(time.perf_counter() - start)
            assert torch.equal(pool[:, :, local_ids], source[:, :, remote_ids]), "the blocks read differ"
            median, p90 = statistics.median(times), sorted(times)[int(0.9 * (len(times) - 1))]
            nbytes = n * pool[:, :, 0].numel() * pool.element_size()
            lines.append(f"{tls:>8}  {n:4d} blocks {nbytes / 2**20:7.1f} MiB  median {1e3 * median:8.2f} ms  "
                         f"p90 {1e3 * p90:8.2f} ms  per block {1e3 * median / n:6.3f} ms  "
                         f"{nbytes / median / 1e9:6.2f} GB/s")
        connector.close()
        return lines
    finally:
        peer.stdin.close()
        peer.wait(30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tls", default="default,tcp,cma",
                        help="comma-separated UCX_TLS settings to compare ('cma' gets ',tcp' for the wire-up)")
    parser.add_argument("--blocks", default="1,8,32,128", help="blocks per transfer")
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--pool-blocks", type=int, default=256)
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)  # the prefill side
    parser.add_argument("--one", action="store_true", help=argparse.SUPPRESS)    # one UCX_TLS setting
    args = parser.parse_args()
    if args.serve:
        return serve(args.pool_blocks)
    if args.one:
        sizes = [int(n) for n in args.blocks.split(",")]
        print("\n".join(measure(args.tls, sizes, args.rounds, args.pool_blocks)), flush=True)
        return
    print(f"{'UCX_TLS':>8}  (pool of {args.pool_blocks} blocks of 720 KiB, {args.rounds} rounds)", flush=True)
    for tls in args.tls.split(","):
        # Each setting in a fresh process of its own: UCX reads UCX_TLS once, when the first agent starts.
        subprocess.run([sys.executable, __file__, "--one", "--tls", "cma,tcp" if tls == "cma" else tls, "--blocks",
                        args.blocks, "--rounds", str(args.rounds), "--pool-blocks", str(args.pool_blocks)], check=True)


if __name__ == "__main__":
    main()
