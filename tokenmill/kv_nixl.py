"""The NIXL KV connector: a decode instance reads a finished prompt's blocks straight out of the
prefill instance's pool, with the pull protocol of vLLM's NixlConnector. NIXL picks the transport
the two agents share through UCX (RDMA, CUDA IPC, shared memory, TCP); on one host without a GPU
that is shared memory or TCP over loopback.

    prefill instance                                  decode instance
    at start: registers its pool with its agent,      at start: registers its pool with its agent
    serves the agent's metadata on a side channel
    (a TCP listener, kv_side_channel_host:port)
    a request with do_remote_decode ends: its
    prompt's full blocks are held, and its params
    say where: remote_engine_id, remote_host,
    remote_port, remote_block_ids, remote_request_id
                                                      admission: fetches that agent's metadata (once
                                                      per engine id), starts a READ of the remote
                                                      blocks into the request's own (one transfer);
                                                      each step asks whether it is done, and gives up
                                                      after kv_transfer_timeout seconds; the read's
                                                      notification names the remote request
    frees the blocks on that notification, or after
    kv_hold_timeout seconds

The pool is registered whole. A transfer lists one region per (layer, K|V, block), since a
block's (kv_heads, block_size, row) is contiguous in the pool and nothing wider is:

    pool     (layers, 2, blocks + 1, kv_heads, block_size, row)   row: head_dim (+ 4 for int8, worker.py)
    region   (layer * 2 + kv) * (blocks + 1) + block

A fetch or read that fails (the prefill instance gone, a timeout, a pool of another layout) fails
the load: the decode instance computes the prompt itself, and tells the prefill instance it may
free the blocks. Each request is loaded at most once: a request preempted on the decode instance
recomputes, since the remote blocks may be gone by then. A request that ends while its read runs
has it cancelled before its blocks are freed. The agent is used only on the scheduler's thread;
the side channel serves bytes made at start. close() releases the agent and the listener,
and so does a finalizer at the latest at interpreter exit: agents left alive at exit can crash
both processes.
"""

from __future__ import annotations

import base64
import json
import logging
import socket
import threading
import time
import uuid
import weakref
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from tokenmill.kv_connector import external_block_span, hands_over, prompt_blocks_computed
from tokenmill.outputs import FinishResult
from tokenmill.request import Request

logger = logging.getLogger(__name__)

READ_MEMORY = 65536          # remote requests remembered as read (a sibling of one reads nothing)
FAILED_ENGINE_PAUSE = 30.0   # seconds a prefill engine that failed a fetch or read is not tried again
PROGRESS_DELAY_US = 1000     # the NIXL progress thread's poll timeout (make_agent); poll() counts whole ms


def well_formed(params: dict | None) -> bool:
    """Whether a request's kv_transfer_params name remote blocks to read, with the types this
    connector writes them in (they come from clients: anything else reads nothing)."""
    if not isinstance(params, dict) or params.get("do_remote_prefill") is not True:
        return False
    ids = params.get("remote_block_ids")
    return (isinstance(params.get("remote_engine_id"), str) and isinstance(params.get("remote_host"), str)
            and isinstance(params.get("remote_port"), int) and isinstance(params.get("remote_request_id"), (str, int))
            and isinstance(params.get("remote_expires_at"), (int, float)) and isinstance(ids, list)
            and all(isinstance(b, int) and not isinstance(b, bool) for b in ids))


def pool_regions(address: int, shape: tuple[int, ...], element_size: int, device_id: int = 0) -> np.ndarray:
    """The (address, length, device id) of every (layer, K|V, block) region of a contiguous pool of
    `shape` at `address`, in region order (module docstring): (layers * 2 * blocks, 3) int64."""
    layers, kv, blocks = shape[:3]
    length = int(np.prod(shape[3:])) * element_size  # one block of one layer's K or V
    starts = address + np.arange(layers * kv * blocks, dtype=np.int64) * length
    return np.stack([starts, np.full_like(starts, length), np.full_like(starts, device_id)], axis=1)


def region_indices(block_ids: list[int], layers: int, blocks: int) -> np.ndarray:
    """The regions of these blocks, block by block, each one's layers' K and V in order: int32."""
    planes = np.arange(layers * 2, dtype=np.int64) * blocks  # (layers * 2,)
    return (np.asarray(block_ids, dtype=np.int64)[:, None] + planes[None, :]).reshape(-1).astype(np.int32)


class SideChannel:
    """A TCP listener that sends one payload (the agent's metadata, JSON) to whoever connects."""

    def __init__(self, host: str, port: int, payload: bytes) -> None:
        self.sock = socket.create_server((host, port))
        self.port = self.sock.getsockname()[1]
        self.payload = payload
        self.thread = threading.Thread(target=self._serve, name="tokenmill-kv-side-channel", daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return  # closed
            with conn:
                try:
                    conn.settimeout(5.0)
                    conn.sendall(self.payload)
                except OSError:
                    pass  # the peer went away: its fetch fails, not this listener

    def close(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)  # wakes accept() on Linux
        except OSError:
            pass
        self.sock.close()
        self.thread.join(5.0)


def fetch_metadata(host: str, port: int, timeout: float) -> dict:
    """What a prefill instance's side channel serves (SideChannel, NixlConnector._payload)."""
    chunks = []
    with socket.create_connection((host, port), timeout=timeout) as conn:
        conn.settimeout(timeout)
        while chunk := conn.recv(1 << 16):
            chunks.append(chunk)
    return json.loads(b"".join(chunks))


@dataclass
class _Remote:
    """A prefill instance's agent, added to ours, with its pool's regions prepared."""
    name: str
    regions: object         # the prepped descriptor list of its pool's regions
    num_layers: int
    num_blocks: int         # blocks in its pool, the scratch one included


@dataclass
class _Load:
    """A read in flight into a request's blocks."""
    request_id: str
    engine_id: str          # the prefill instance read from
    notice: bytes           # the read's completion notice: the remote request's id
    num_blocks: int
    deadline: float         # clock time past which it is given up
    handle: object = None   # NIXL's transfer handle, until released


def make_agent(name: str, progress_delay_us: int = PROGRESS_DELAY_US):
    """A NIXL agent with the UCX backend whose progress thread sleeps between polls.

    UCX's progress thread waits in poll() on its workers' event descriptors, so traffic (a peer's
    read of this pool over TCP, a notification) wakes it at once; the agent config's `pthrDelay`
    is that poll's timeout, after which every worker is progressed anyway. The thread is kept
    because without it UCX moves only when the engine calls the agent, and an idle prefill
    instance whose blocks a peer reads over TCP would not. nixl_agent.__init__ fixes pthrDelay at
    0, a timeout that returns at once: the thread spins, taking a core from the engine's threads.
    nixl_agent_config has no field for it, so the agent is made without backends or thread, and
    its binding replaced by one built with the delay (nixlAgentConfig, NIXL's documented C++
    config) before the UCX backend is created on it."""
    try:
        from nixl_cu12 import _bindings
        from nixl_cu12._api import nixl_agent, nixl_agent_config
    except ImportError as exc:
        raise ImportError("kv_connector 'nixl' needs nixl-cu12: pip install nixl-cu12 (or tokenmill[disagg]; "
                          f"not the 'nixl' meta-package, which pulls both CUDA variants): {exc}") from exc
    agent = nixl_agent(name, nixl_agent_config(enable_prog_thread=False, backends=[]))
    config = _bindings.nixlAgentConfig()
    config.useProgThread = True
    config.useListenThread = False
    config.syncMode = _bindings.NIXL_THREAD_SYNC_NONE  # nixl_agent's own choice without a listener thread
    config.pthrDelay = progress_delay_us
    agent.agent = _bindings.nixlAgent(name, config)
    agent.create_backend("UCX")
    return agent


class _Agent:
    """The one reference to the NIXL agent, with everything made from it, so that close() can
    release them in order and drop the agent (its destructor disconnects from every peer)."""

    def __init__(self, name: str, pool) -> None:
        self.agent = make_agent(name)
        self.registered = self.agent.register_memory(pool)
        self.local = self.agent.prep_xfer_dlist(
            "NIXL_INIT_AGENT", pool_regions(pool.data_ptr(), tuple(pool.shape), pool.element_size(),
                                            pool.device.index or 0),
            "DRAM" if pool.device.type == "cpu" else "VRAM")
        self.remotes: dict[str, _Remote] = {}  # by engine id

    def forget(self, engine_id: str) -> None:
        remote = self.remotes.pop(engine_id, None)
        if remote is None:
            return
        try:
            remote.regions.release()
            self.agent.remove_remote_agent(remote.name)
        except Exception as exc:  # a peer already gone: nothing left to undo
            logger.debug("forgetting agent %s: %s", remote.name, exc)

    def close(self) -> None:
        if self.agent is None:
            return
        for engine_id in list(self.remotes):
            self.forget(engine_id)
        self.local.release()
        self.agent.deregister_memory(self.registered)
        self.agent = self.local = self.registered = None


class NixlConnector:
    def __init__(self, role: str, worker, block_size: int, fingerprint: str, host: str, port: int,
                 hold_timeout: float, transfer_timeout: float, clock=time.monotonic) -> None:
        self.role = role                  # "prefill", "decode" or "both"
        self.block_size = block_size
        self.fingerprint = fingerprint    # what a peer's pool must match (kv_connector.pool_fingerprint)
        self.hold_timeout = hold_timeout
        self.transfer_timeout = transfer_timeout
        self.clock = clock
        self.engine_id = uuid.uuid4().hex
        pool = self.pool = worker.kv_cache  # (layers, 2, blocks + 1, kv_heads, block_size, row), registered:
                                            # kept alive here as long as the agent may read or write it
        self.num_layers, self.num_blocks = pool.shape[0], pool.shape[2]
        self.link = _Agent(self.engine_id, pool)
        self._close_link = weakref.finalize(self, self.link.close)
        self.host, self.channel = host, None
        # what decode instances connect to: a wildcard bind is reachable at this host's name
        self.advertised_host = socket.getfqdn() if host in ("", "0.0.0.0", "::") else host
        if role != "decode":
            self.channel = SideChannel(host, port, self._payload(pool))
            self._close_channel = weakref.finalize(self, self.channel.close)
        self.holds: dict[str, float] = {}  # prefill: held request id -> when it stops waiting for the read
        self.tried: set[str] = set()       # decode: requests whose load was attempted (never twice)
        self.read: OrderedDict[tuple[str, str], None] = OrderedDict()  # decode: (engine, remote request) read
        self.failed_engines: dict[str, float] = {}  # decode: engine id -> until when it is not tried again
        self.loads: dict[str, _Load] = {}  # decode: reads in flight, by request id
        self._ended: dict[str, bool] = {}  # decode: loads that ended at start, for finished_loads
        self.num_blocks_held = 0           # cumulative, for tests and metrics
        self.num_blocks_loaded = 0
        self.num_load_failures = 0
        self.num_hold_timeouts = 0

    @property
    def port(self) -> int | None:
        """The side channel's port (the one bound when kv_side_channel_port is 0); None on decode."""
        return self.channel.port if self.channel is not None else None

    def _payload(self, pool) -> bytes:
        return json.dumps({
            "engine_id": self.engine_id, "fingerprint": self.fingerprint,
            "agent_metadata": base64.b64encode(self.link.agent.get_agent_metadata()).decode(),
            "pool_address": pool.data_ptr(), "pool_shape": list(pool.shape), "element_size": pool.element_size(),
            "device_id": pool.device.index or 0,
            "memory": "DRAM" if pool.device.type == "cpu" else "VRAM"}).encode()

    def close(self) -> None:
        for load in self.loads.values():
            self._release(load)
        self.loads.clear()
        if self.channel is not None:
            self._close_channel()
        self._close_link()

    # ---- decode side ----------------------------------------------------------------------

    def num_matched_tokens(self, request: Request, num_local_tokens: int) -> int:
        params = request.params.kv_transfer_params
        if (self.role == "prefill" or self.link.agent is None or request.request_id in self.tried
                or not well_formed(params) or time.time() > params["remote_expires_at"]
                or (params["remote_engine_id"], str(params["remote_request_id"])) in self.read
                or self.failed_engines.get(params["remote_engine_id"], 0.0) > self.clock()):
            return 0  # (expired: the prefill instance may have freed and reused the blocks)
        return max(0, len(params["remote_block_ids"]) * self.block_size - num_local_tokens)

    def start_load(self, request: Request, block_ids: list[int], num_local_tokens: int,
                   num_external_tokens: int) -> bool:
        self.tried.add(request.request_id)
        params = request.params.kv_transfer_params
        # One read per remote request: its notice lets the prefill instance free the blocks, so a
        # sibling (n > 1) takes them from this instance's prefix cache instead.
        self.read[(params["remote_engine_id"], str(params["remote_request_id"]))] = None
        while len(self.read) > READ_MEMORY:
            self.read.popitem(last=False)
        first, last = external_block_span(num_local_tokens, num_external_tokens, self.block_size)
        load = _Load(request.request_id, params["remote_engine_id"], str(params["remote_request_id"]).encode(),
                     last - first, self.clock() + self.transfer_timeout)
        try:
            remote = self._remote(load.engine_id, params["remote_host"], int(params["remote_port"]))
            load.handle = self._start_read(remote, params["remote_block_ids"][first:last], block_ids[first:last],
                                           load.notice)
            state = self.link.agent.transfer(load.handle)
        except Exception as exc:  # (gone, another layout, bad ids): computed here instead
            self._failed(load, exc)
            return False
        self.loads[request.request_id] = load
        if state != "PROC":
            self._ended[request.request_id] = self._end(load, state)
        return True

    def finished_loads(self) -> dict[str, bool]:
        ended, self._ended = self._ended, {}
        for request_id, load in list(self.loads.items()):
            if request_id not in self.loads:
                continue  # failed with another read from its prefill instance, just now
            state = self.link.agent.check_xfer_state(load.handle)
            if state != "PROC" or self.clock() > load.deadline:
                ended[request_id] = self._end(load, state)
        return ended

    def cancel_load(self, request_id: str) -> None:
        load = self.loads.pop(request_id, None)
        self._ended.pop(request_id, None)
        if load is not None:
            self._release(load)  # cancels a read still running
            self._notify_anyway(load.engine_id, load.notice)

    def _end(self, load: _Load, state: str) -> bool:
        """A read that ended (DONE, failed, or past its deadline): released, counted, True if done."""
        del self.loads[load.request_id]
        self._release(load)
        if state == "DONE":
            self.num_blocks_loaded += load.num_blocks
            return True
        self._failed(load, TimeoutError(f"still running after {self.transfer_timeout} s") if state == "PROC"
                     else RuntimeError(f"the transfer ended in state {state}"))
        return False

    def _failed(self, load: _Load, exc: Exception) -> None:
        """A read that failed, released and its peer told. The prefill instance is forgotten
        (fetched again next time: it may have restarted), so its other reads in flight fail with it
        (they read through what forgetting it releases); unless the request's own params were at
        fault, it is not tried again for a while."""
        self.num_load_failures += 1
        logger.warning("request %s: reading %d blocks from %s failed (%s: %s); computing them here",
                       load.request_id, load.num_blocks, load.engine_id, type(exc).__name__, exc)
        self._release(load)
        self._notify_anyway(load.engine_id, load.notice)
        for other in [x for x in self.loads.values() if x.engine_id == load.engine_id and x is not load]:
            del self.loads[other.request_id]
            self._release(other)
            self._notify_anyway(other.engine_id, other.notice)
            self.num_load_failures += 1
            self._ended[other.request_id] = False
        self.link.forget(load.engine_id)
        if not isinstance(exc, (ValueError, LookupError)):  # unreachable or broken, not a request's bad params
            self.failed_engines[load.engine_id] = self.clock() + FAILED_ENGINE_PAUSE  # not a stall each

    @staticmethod
    def _release(load: _Load) -> None:
        if load.handle is not None:
            try:
                load.handle.release()
            except Exception as exc:
                logger.warning("releasing a NIXL transfer failed: %s", exc)
            load.handle = None

    def _remote(self, engine_id: str, host: str, port: int) -> _Remote:
        """The prefill instance's agent, fetched from its side channel the first time."""
        remote = self.link.remotes.get(engine_id)
        if remote is not None:
            return remote
        meta = fetch_metadata(host, port, self.transfer_timeout)
        if meta["engine_id"] != engine_id:
            raise LookupError(f"{host}:{port} is engine {meta['engine_id']}, not {engine_id} (restarted?)")
        if meta["fingerprint"] != self.fingerprint:
            raise ValueError(f"its pool is {meta['fingerprint']}, this one {self.fingerprint}")
        agent = self.link.agent
        name = agent.add_remote_agent(base64.b64decode(meta["agent_metadata"]))
        name = name.decode() if isinstance(name, bytes) else name
        shape = tuple(meta["pool_shape"])
        regions = agent.prep_xfer_dlist(name, pool_regions(meta["pool_address"], shape, meta["element_size"],
                                                           meta.get("device_id", 0)),
                                        meta["memory"])
        remote = self.link.remotes[engine_id] = _Remote(name, regions, shape[0], shape[2])
        return remote

    def _start_read(self, remote: _Remote, remote_ids: list[int], local_ids: list[int], notice: bytes):
        """A prepared transfer reading remote blocks into local ones, whose completion notifies the
        remote agent with `notice`; ValueError for ids outside the remote pool."""
        if len(remote_ids) != len(local_ids) or any(not 0 <= b < remote.num_blocks - 1 for b in remote_ids):
            raise ValueError(f"remote blocks {remote_ids} do not fit its pool of {remote.num_blocks - 1}")
        return self.link.agent.make_prepped_xfer(
            "READ", self.link.local, region_indices(local_ids, self.num_layers, self.num_blocks),
            remote.regions, region_indices(remote_ids, remote.num_layers, remote.num_blocks), notif_msg=notice)

    def _notify_anyway(self, engine_id: str, notice: bytes) -> None:
        """After a failed load, tell a prefill agent still known that it may free the blocks."""
        remote = self.link.remotes.get(engine_id)
        if remote is not None:
            try:
                self.link.agent.send_notif(remote.name, notice)
            except Exception as exc:
                logger.debug("notifying %s: %s", remote.name, exc)

    # ---- prefill side ---------------------------------------------------------------------

    def on_finish(self, request: Request, block_ids: list[int]) -> FinishResult:
        self.tried.discard(request.request_id)
        if self.role == "decode" or self.link.agent is None or not hands_over(request):
            return FinishResult()  # nothing asked, or aborted or failed: nothing to hand over
        held = list(block_ids[:prompt_blocks_computed(request, self.block_size)])
        if held:
            self.holds[request.request_id] = self.clock() + self.hold_timeout
            self.num_blocks_held += len(held)
        # the decode side starts no read after this (wall clock): one started then ends before the
        # blocks are freed, unless it outlasts what is left of the hold (its half at least)
        expires = time.time() + max(self.hold_timeout / 2, self.hold_timeout - self.transfer_timeout - 1.0)
        return FinishResult({
            "do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": self.engine_id,
            "remote_host": self.advertised_host, "remote_port": self.port, "remote_block_ids": held,
            "remote_request_id": request.request_id, "remote_expires_at": expires, "tp_size": 1},
            hold_blocks=bool(held))

    def released(self) -> list[str]:
        if not self.holds:
            return []
        done = []
        for messages in self.link.agent.get_new_notifs().values() if self.link.agent is not None else ():
            for message in messages:
                request_id = message.decode(errors="replace")
                if self.holds.pop(request_id, None) is not None:
                    done.append(request_id)
        now = self.clock()
        expired = [request_id for request_id, until in self.holds.items() if until <= now]
        for request_id in expired:
            del self.holds[request_id]
            logger.warning("request %s: no decode instance read its blocks within %g s; freeing them",
                           request_id, self.hold_timeout)
        self.num_hold_timeouts += len(expired)
        return done + expired
