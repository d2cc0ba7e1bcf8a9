"""GET /v1/models, /v1/models/{id}, /health, /metrics and /version: what the server serves and
how it is doing."""

from __future__ import annotations

import time
from dataclasses import dataclass

from fastapi.responses import JSONResponse, Response

from tokenmill import __version__
from tokenmill.async_engine import AsyncLLMEngine
from tokenmill.server.errors import check_model
from tokenmill.server.metrics import ServerMetrics
from tokenmill.server.protocol import error_body


@dataclass
class ModelsHandler:
    model_name: str              # the name clients send
    max_model_len: int           # the engine's context length (prompt + output)
    async_engine: AsyncLLMEngine
    server_metrics: ServerMetrics
    machine: dict                # /version's "device" and "cpu" (cpu_info.CpuInfo.as_dict)

    async def models(self):
        return {"object": "list", "data": [{"id": self.model_name, "object": "model", "created": int(time.time()),
                                            "owned_by": "tokenmill", "max_model_len": self.max_model_len}]}

    async def model(self, model_id: str):
        check_model(model_id, self.model_name)
        return (await self.models())["data"][0]

    async def health(self):
        """200 while the engine loop runs; 503 naming its error once it has died, naming a
        tensor-parallel rank that has exited (every step would fail), or while the server shuts
        down (so that a load balancer sends it nothing new)."""
        if self.async_engine.draining:
            return JSONResponse(error_body("the server is shutting down", "server_error",
                                           code="server_shutting_down"), status_code=503)
        if not self.async_engine.is_alive:
            return JSONResponse(error_body(f"engine loop is not running: {self.async_engine.error!r}",
                                           "server_error"), status_code=503)
        if (death := self.async_engine.rank_death()) is not None:
            return JSONResponse(error_body(death, "server_error"), status_code=503)
        return {"status": "ok"}

    async def metrics(self):
        return Response(self.server_metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    async def version(self):
        return {"version": __version__, **self.machine}
