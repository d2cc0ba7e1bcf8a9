"""`tokenmill bench serve`: online latency and throughput over HTTP, against any
OpenAI-compatible server (tokenmill, vLLM, llama.cpp's server) or one it starts itself.

Requests arrive as a Poisson process at each --request-rate (gamma-distributed gaps when
--burstiness is not 1), or as fast as --max-concurrency allows. Each is a streaming
/v1/completions call with a token-id prompt and a fixed output length (vLLM's ignore_eos
extension, which llama.cpp's server also takes), so every server does the same work; for a
server that rejects the field, --no-ignore-eos leaves it out, and for one that takes only
text prompts, --text-prompts decodes the token ids with the model's tokenizer. The run is
bounded by --num-prompts and --max-seconds.

Per request: TTFT (send to first token), ITL (gaps between streamed chunks), TPOT
((end - first token) / (tokens - 1)) and end-to-end latency; goodput counts the requests
per second that met --slo ttft=MS,tpot=MS (none without it: it would repeat req/s).
"""

from __future__ import annotations

import asyncio
import json
import random
import subprocess
import sys
import time
from dataclasses import dataclass, field

import numpy as np

from tokenmill.bench.workloads import random_workload


@dataclass
class Prompt:
    prompt: list[int] | str  # token ids, or their text for servers that take only strings
    max_tokens: int


@dataclass
class RequestResult:
    ok: bool
    output_tokens: int = 0
    ttft: float = 0.0
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)
    error: str = ""

    @property
    def tpot(self) -> float:
        return (self.e2e - self.ttft) / (self.output_tokens - 1) if self.output_tokens > 1 else 0.0


def error_message(body: bytes) -> str:
    """What an error body says: OpenAI's {"error": {"message": ...}}, FastAPI's {"detail": ...},
    {"error": "..."} or {"message": ...} (servers that are not OpenAI's), else its first 200
    characters as text."""
    try:
        payload = json.loads(body)
    except ValueError:
        payload = None
    if isinstance(payload, dict):
        for key in ("error", "detail", "message"):
            value = payload.get(key)
            if isinstance(value, dict):
                value = value.get("message", value)
            if value:
                return str(value)[:200]
    return body[:200].decode(errors="replace").strip()


async def send(client, url: str, model: str, req: Prompt, ignore_eos: bool = True) -> RequestResult:
    body = {"model": model, "prompt": req.prompt, "max_tokens": req.max_tokens, "stream": True,
            "temperature": 0.0, "stream_options": {"include_usage": True}}
    if ignore_eos:
        body["ignore_eos"] = True
    start = time.perf_counter()
    first, last, chunks, usage_tokens, finished = None, None, 0, None, False
    itl, other = [], []  # other: lines that are no SSE data (a plain JSON error body)
    try:
        async with client.stream("POST", url + "/v1/completions", json=body) as response:
            if response.status_code != 200:
                return RequestResult(False, error=f"HTTP {response.status_code}: "
                                                  f"{error_message(await response.aread())}")
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    if len(other) < 100:
                        other.append(line)
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    finished = True
                    break
                payload = json.loads(data)
                if "error" in payload:
                    return RequestResult(False, error=error_message(data.encode()))
                if payload.get("usage"):
                    usage_tokens = payload["usage"].get("completion_tokens")
                choice = payload["choices"][0] if payload.get("choices") else {}
                finished = finished or choice.get("finish_reason") is not None
                # a chunk with text is a token; a first chunk without (an EOS at once, which
                # decodes to nothing) still ends the wait for the first token
                if choice.get("text") or (first is None and choice.get("finish_reason") is not None):
                    now = time.perf_counter()
                    if first is None:
                        first = now
                    else:
                        itl.append(now - last)
                    last = now
                    chunks += 1
    except Exception as exc:  # a dropped connection is a failed request, not a crashed benchmark
        return RequestResult(False, error=f"{type(exc).__name__}: {exc}")
    end = time.perf_counter()
    answer = "\n".join(other).strip()
    if first is None and answer:  # an answer, but no event stream (a JSON error body)
        return RequestResult(False, error=f"no event stream; the server answered: {error_message(answer.encode())}")
    if first is None or not finished:
        return RequestResult(False, error="no tokens received" if first is None else "stream ended unfinished")
    return RequestResult(True, usage_tokens if usage_tokens is not None else chunks, first - start, end - start, itl)


def arrival_times(count: int, rate: float, burstiness: float, rng: random.Random) -> np.ndarray:
    """Seconds from the start at which each request goes out: gamma gaps of mean 1 / rate (Poisson
    arrivals at burstiness 1), all at 0 for an infinite rate. Drawn up front and slept towards from
    the start: sleeping each gap after the last wake-up added every late wake-up (the event loop
    busy with open streams) to the schedule, and the rate sent sank below the one asked for."""
    if rate == float("inf"):
        return np.zeros(count)
    return np.cumsum([0.0] + [rng.gammavariate(burstiness, 1.0 / (rate * burstiness)) for _ in range(count - 1)])


async def run_rate(url: str, model: str, workload: list[Prompt], rate: float, burstiness: float,
                   max_concurrency: int | None, max_seconds: float, seed: int, progress: bool,
                   ignore_eos: bool = True) -> tuple:
    import httpx
    from tqdm.auto import tqdm

    rng = random.Random(seed)
    limit = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    results: list[RequestResult] = []
    timeout = httpx.Timeout(max_seconds + 60)
    bar = tqdm(total=len(workload), desc=f"rate {rate}", unit="req", disable=not progress)

    async def one(client, req):
        if limit is not None:
            async with limit:
                result = await send(client, url, model, req, ignore_eos)
        else:
            result = await send(client, url, model, req, ignore_eos)
        results.append(result)
        bar.update(1)

    arrivals = arrival_times(len(workload), rate, burstiness, rng)
    start = time.perf_counter()
    async with httpx.AsyncClient(timeout=timeout, limits=httpx.Limits(max_connections=None)) as client:
        tasks = []
        for req, at in zip(workload, arrivals):
            await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
            if time.perf_counter() - start > max_seconds:
                break
            tasks.append(asyncio.create_task(one(client, req)))
        await asyncio.gather(*tasks)
    bar.close()
    return results, time.perf_counter() - start


def summarize(results: list[RequestResult], wall: float, rate: float, slo: dict[str, float]) -> dict:
    ok = [r for r in results if r.ok]

    def pct(values) -> dict[str, float | None]:
        if not len(values):  # no sample (no request succeeded): no figure, rather than a made-up 0
            return dict.fromkeys(("mean", "p50", "p90", "p99"))
        return {"mean": float(np.mean(values)), "p50": float(np.percentile(values, 50)),
                "p90": float(np.percentile(values, 90)), "p99": float(np.percentile(values, 99))}
    good = [r for r in ok if r.ttft * 1e3 <= slo.get("ttft", float("inf"))
            and r.tpot * 1e3 <= slo.get("tpot", float("inf"))]
    itl = [x for r in ok for x in r.itl]
    return {"request_rate": rate, "completed": len(ok), "failed": len(results) - len(ok), "wall_s": wall,
            "request_throughput": len(ok) / wall, "output_tok_s": sum(r.output_tokens for r in ok) / wall,
            "goodput_req_s": len(good) / wall if slo else None, "ttft": pct([r.ttft for r in ok]),
            "tpot": pct([r.tpot for r in ok if r.output_tokens > 1]),  # one token has no time per output token
            "itl": pct(itl), "e2e": pct([r.e2e for r in ok]),
            "errors": sorted({r.error for r in results if not r.ok})[:5],
            "ttft_samples": [r.ttft for r in ok], "itl_samples": itl}


def _figure(value: float | None, width: int, spec: str) -> str:
    return f"{'-':>{width}}" if value is None else f"{value:>{width}{spec}}"


def format_rows(rows: list[dict]) -> str:
    columns = [f"{m} {p}" for m in ("ttft", "tpot", "itl", "e2e") for p in ("mean", "p50", "p90", "p99")]
    head = (f"{'rate':>6} {'done':>5} {'fail':>4} {'req/s':>7} {'out tok/s':>9} {'goodput':>8} "
            + " ".join(f"{c:>10}" for c in columns))
    lines = [head, "(latencies in ms; -: no sample, or no goodput without --slo)"]
    for r in rows:
        lat = " ".join(_figure(None if r[m][p] is None else r[m][p] * 1e3, 10, ".1f")
                       for m in ("ttft", "tpot", "itl", "e2e") for p in ("mean", "p50", "p90", "p99"))
        lines.append(f"{r['request_rate']:>6} {r['completed']:>5} {r['failed']:>4} {r['request_throughput']:>7.2f} "
                     f"{r['output_tok_s']:>9.1f} {_figure(r['goodput_req_s'], 8, '.2f')} {lat}")
    return "\n".join(lines)


def start_server(args, port: int) -> subprocess.Popen:
    """`tokenmill serve` on 127.0.0.1 with this command's model and engine options."""
    import dataclasses

    from tokenmill.config import EngineConfig
    cmd = [sys.executable, "-m", "tokenmill.cli", "--log-level", "WARNING", "serve", "--port", str(port),
           "--served-model-name", "bench"]
    if args.model:
        cmd.insert(cmd.index("--port"), args.model)
    for f in dataclasses.fields(EngineConfig):
        value = getattr(args, f.name, None)
        if f.name != "model" and value is not None and value != f.default:
            cmd += ["--" + f.name.replace("_", "-"), str(value)]
    return subprocess.Popen(cmd)


def wait_healthy(url: str, proc: subprocess.Popen | None, timeout: float) -> None:
    """Wait for /health to answer 200: for a server this command started (loading its model, maybe
    compiling kernels), or a moment for one at --base-url. A URL that cannot be used fails at once."""
    import httpx
    print(f"waiting for {url}/health (up to {timeout:.0f} s)", file=sys.stderr)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise ChildProcessError(f"the server exited with {proc.returncode} before it was healthy")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except (httpx.UnsupportedProtocol, httpx.InvalidURL) as exc:
            raise ValueError(f"--base-url {url!r}: {exc}") from None
        except httpx.TransportError:
            pass  # not up yet
        time.sleep(0.5)
    raise ConnectionError(f"no healthy server at {url} after {timeout:.0f} s")


def first_model(url: str) -> str:
    """The first model the server lists at /v1/models (OpenAI's {"data": [{"id": ...}]}); a server
    that answers otherwise is one error saying what it answered."""
    import httpx
    response = httpx.get(url + "/v1/models", timeout=10)
    try:
        return response.json()["data"][0]["id"]
    except (ValueError, LookupError, TypeError):
        raise ValueError(f"{url}/v1/models named no model (HTTP {response.status_code}: "
                         f"{error_message(response.content)}); give --served-model") from None


def rate_prompts(args, index: int, tokenizer=None) -> list[Prompt]:
    """The prompts of the index-th request rate, drawn with seed dataset_seed + index: the same
    prompts again would come from a prefix-caching server's cache, and every rate after the first
    would show first-token times without the prefills. With a tokenizer, as text (special ids
    would come back as control tokens, so the server's token count may differ a little)."""
    prompts = [Prompt(r.prompt_token_ids, r.max_tokens) for r in
               random_workload(args.num_prompts, tuple(args.prompt_len), tuple(args.output_len),
                               args.dataset_seed + index)]
    if tokenizer is not None:
        prompts = [Prompt(tokenizer.decode(p.prompt, skip_special_tokens=True), p.max_tokens) for p in prompts]
    return prompts


def bench_serve(args) -> dict:
    import socket

    tokenizer = None
    if args.text_prompts:  # before a server starts: a bad --tokenizer is said at once
        from tokenmill.models.loader import load_tokenizer, resolve_model_path
        tokenizer = load_tokenizer(resolve_model_path(args.model), args.tokenizer)
    slo = args.slo or {}
    proc = None
    url = args.base_url
    if url is None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        proc = start_server(args, port)
        url = f"http://127.0.0.1:{port}"
    url = url.rstrip("/").removesuffix("/v1")
    try:
        wait_healthy(url, proc, timeout=300 if proc is not None else 30)
        model = args.served_model or first_model(url)
        rows = []
        for i, rate in enumerate(args.request_rate):
            workload = rate_prompts(args, i, tokenizer)
            results, wall = asyncio.run(run_rate(url, model, workload, rate, args.burstiness, args.max_concurrency,
                                                 args.max_seconds, args.dataset_seed, progress=True,
                                                 ignore_eos=args.ignore_eos))
            rows.append(summarize(results, wall, rate, slo))
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(30)
    print()
    print(f"server {url}, model {model!r}, {args.num_prompts} requests per rate (new prompts for each), "
          f"max concurrency {args.max_concurrency or 'unbounded'}, SLO {slo or 'none'}")
    print(format_rows(rows))
    if args.plot is not None:
        from tokenmill.bench.plots import plot_cdfs, plot_latency_vs_rate
        print(f"plots: {plot_latency_vs_rate(rows, args.plot)}, {plot_cdfs(rows, args.plot)}")
    for r in rows:
        if r["errors"]:
            print(f"rate {r['request_rate']}: errors {r['errors']}")
    return {"server": url, "rows": [{k: v for k, v in r.items() if not k.endswith("_samples")} for r in rows]}
