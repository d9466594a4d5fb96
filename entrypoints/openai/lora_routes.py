"""LoRA adapters through the server: `model=<adapter name>` picks one, /v1/models lists them with
their base as `parent`, and vLLM's `POST /v1/load_lora_adapter` / `/v1/unload_lora_adapter`
(bodies {"lora_name", "lora_path"}) add and remove them at run time (behind the API key, as every
/v1 route). The engine's LoRAManager (engine/lora/manager.py) does the work; reading a folder runs
on the server's worker threads, never on the event loop or the step thread. A broken adapter is
a 400 naming the problem (models/lora.LoRAError) and the server serves on; an unknown name, 404.
"""

from __future__ import annotations

import asyncio

from aiohttp import web

from engine.lora_config import LoRARequest
from entrypoints.openai.errors import ProtocolError
from entrypoints.openai.prepare import parse_json


class ModelNames:
    """What a request's `model` may name: the served model's names, then every loaded adapter's
    (read live from the manager, so adapters loaded at run time are found)."""

    def __init__(self, base: tuple[str, ...], manager):
        self.base = base
        self.manager = manager

    def adapters(self) -> list[str]:
        return self.manager.names() if self.manager is not None else []

    def __contains__(self, name) -> bool:
        return name in self.base or (self.manager is not None and self.manager.get(name) is not None)

    def __iter__(self):
        return iter((*self.base, *self.adapters()))


class LoRARoutes:
    def __init__(self, manager, names: ModelNames, pool, parent: str):
        self.manager = manager  # None: the engine serves no adapters
        self.names = names
        self.pool = pool
        self.parent = parent

    def add_routes(self, app: web.Application) -> None:
        app.router.add_post("/v1/load_lora_adapter", self.load)
        app.router.add_post("/v1/unload_lora_adapter", self.unload)

    def model_cards(self, created: int, max_model_len: int) -> list[dict]:
        cards = []
        for name in self.names.adapters():
            request = self.manager.get(name)
            if request is not None:
                cards.append({"id": name, "object": "model", "created": created, "owned_by": "jaxserve",
                              "root": request.lora_path, "parent": self.parent, "max_model_len": max_model_len})
        return cards

    async def adapter_for(self, model: str | None):
        """The LoadedAdapter a request's `model` names (loaded on a worker thread), None: the base."""
        if model is None or model in self.names.base or self.manager is None:
            return None
        try:
            return await self._run(self.manager.resolve, model)
        except ValueError as exc:
            status = 404 if self.manager.get(model) is None else 400
            raise ProtocolError(str(exc), param="model", status=status,
                                code="model_not_found" if status == 404 else None) from None

    async def _run(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self.pool, fn, *args)

    async def _body(self, request: web.Request, *required: str) -> dict:
        if self.manager is None:
            raise ProtocolError("This server serves no LoRA adapters: start it with --enable_lora")
        body = parse_json(await request.read())
        if not isinstance(body, dict):
            raise ProtocolError("The request body must be a JSON object")
        for key in required:
            value = body.get(key)
            if not isinstance(value, str) or not value:
                raise ProtocolError(f"'{key}' must be a non-empty string", param=key)
        return body

    async def load(self, request: web.Request) -> web.Response:
        body = await self._body(request, "lora_name", "lora_path")
        name, path = body["lora_name"], body["lora_path"]
        if name in self.names:
            raise ProtocolError(f"The model {name!r} is already loaded", param="lora_name")
        try:
            await self._run(lambda: self.manager.add(LoRARequest(name, self.manager.new_id(), path)))
        except ValueError as exc:  # LoRAError: the folder, tensor or field at fault
            raise ProtocolError(f"Cannot load LoRA adapter {name!r}: {exc}", param="lora_path") from None
        return web.Response(text=f"Success: LoRA adapter '{name}' added successfully.")

    async def unload(self, request: web.Request) -> web.Response:
        body = await self._body(request, "lora_name")
        name = body["lora_name"]
        if not self.manager.remove(name):
            raise ProtocolError(f"The LoRA adapter {name!r} is not loaded", param="lora_name", status=404,
                                code="model_not_found")
        return web.Response(text=f"Success: LoRA adapter '{name}' removed successfully.")
