"""The cluster's and the front's own routes: models, version, health, metrics, new weights, LoRA adapters."""

from __future__ import annotations

import importlib.metadata
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from infer.client.api.admission import authorize, max_model_len
from infer.client.api.errors import unhealthy
from infer.client.api.front import Front
from infer.client.api.metrics import CONTENT_TYPE
from infer.client.api.schemas import ApiError, LoadLoraAdapterRequest, UnloadLoraAdapterRequest, UpdateWeightsRequest
from infer.client.engine_client import ClusterError
from infer.protocol.codes import ClusterState
from infer.protocol.logsafe import safe
from infer.protocol.lora import LoRARequest
from infer.protocol.messages import ClusterStats

try:
    VERSION = importlib.metadata.version("infer")
except importlib.metadata.PackageNotFoundError:  # running from a tree that was never installed
    VERSION = "0+unknown"


class Admin:
    """GET /v1/models, /version, /health, /metrics; POST /v1/update_weights, /v1/load_lora_adapter,
    /v1/unload_lora_adapter."""

    def __init__(self, front: Front) -> None:
        self.front = front

    async def models(self, request: Request) -> Response:
        authorize(request, self.front.config.api_key)
        view: ClusterStats | None
        try:
            view = await self.front.admission.cluster_view()
        except ApiError:
            view = self.front.admission.last_view
        try:
            await self.front.refresh_adapters()
        except (ClusterError, ValueError):
            pass  # the adapters as last seen
        if view is not None and len(view.models) > 1:
            return JSONResponse({"object": "list", "data": self._model_cards(view)})
        max_len = max_model_len(view, healthy_only=False) if view is not None else None
        card = self._card(self.front.config.served_model_name, self.front.engine.model_id, None, max_len)
        adapters = [
            self._card(name, path, self.front.config.served_model_name, max_len)
            for name, path in sorted(self.front.lora_adapters.items())
            if name != self.front.config.served_model_name  # `model` names the base model: one id, one model
        ]
        return JSONResponse({"object": "list", "data": [card, *adapters]})

    def _card(self, name: str, root: str | None, parent: str | None, max_len: int | None) -> dict[str, Any]:
        return {
            "id": name,
            "object": "model",
            "created": self.front.created,
            "owned_by": "infer",
            "root": root,
            "parent": parent,
            "max_model_len": max_len,
        }

    def _model_cards(self, view: ClusterStats) -> list[dict[str, Any]]:
        """Every model of a cluster of several, then each one's LoRA adapters with it as their parent; the model
        Welcome named (the cluster's default) under this front's --served-model-name."""
        cards, adapters = [], []
        for model in view.models:
            name = self.front.served_name(model.model_id)
            cards.append(self._card(name, model.model_id, None, model.max_model_len))
            adapters += [
                self._card(adapter, path, name, model.max_model_len)
                for adapter, path in sorted(model.lora_adapters.items())
            ]
        return cards + adapters

    async def version(self, request: Request) -> Response:
        authorize(request, self.front.config.api_key)
        return JSONResponse({"version": VERSION})

    async def health(self, request: Request) -> Response:
        """200 only if a fresh round trip to the cluster shows it running with a healthy worker."""
        try:
            view = await self.front.admission.cluster_view(fresh=True)
        except ApiError as e:
            return unhealthy(e.message, self.front.config.retry_after)
        healthy = view.num_healthy_workers
        if view.state != ClusterState.RUNNING or healthy == 0:
            why = f"cluster is {view.state}" if view.state != ClusterState.RUNNING else "no healthy worker"
            return unhealthy(why, self.front.config.retry_after, view)
        return JSONResponse(
            {"status": "ok", "state": view.state, "healthy_workers": healthy, "workers": len(view.workers)}
        )

    async def metrics_text(self, request: Request) -> Response:
        try:
            view = await self.front.admission.cluster_view(fresh=True)
        except ApiError:
            view = None
        return Response(self.front.metrics.exposition(view, self.front.served_name), media_type=CONTENT_TYPE)

    async def update_weights(self, request: Request) -> Response:
        """POST /v1/update_weights {"model", "path", "on_running", "timeout"}: every engine loads the safetensors
        directory `path` (all or nothing); 200 {"weight_version": N} once all serve it. Behind the API key; through
        a cluster it needs the front's key to be an administrator's: the front never looks at `path` itself, so a
        front whose key may not refit answers the same refusal whatever the path. 400 with the reason when the
        update is refused (a bad tensor, a path no worker reads, a suspended cluster): the old weights keep
        serving on every worker."""
        body = await self.front.parse(request, UpdateWeightsRequest)
        try:
            version = await self.front.engine.update_weights(
                body.path, on_running=body.on_running, timeout=body.timeout
            )
        except (ValueError, ClusterError) as e:
            raise ApiError(400, f"update_weights failed: {safe(e, 2000)}", param="path") from None
        return JSONResponse({"object": "weight_update", "weight_version": version, "path": body.path})

    async def load_lora_adapter(self, request: Request) -> Response:
        """vLLM's POST /v1/load_lora_adapter {"lora_name", "lora_path"}: every engine loads the PEFT folder, served
        from then on as model `lora_name`. Behind the API key; through a cluster the front's key must be an
        administrator's (the coordinator refuses a client key before any worker reads the path). 400 with the reason
        otherwise (a missing file, a rank above --max-lora-rank, LoRA not enabled, the name taken)."""
        body = await self.front.parse(request, LoadLoraAdapterRequest)
        if body.lora_name == self.front.config.served_model_name:
            raise ApiError(400, f"lora_name {body.lora_name!r} is the served model's name", param="lora_name")
        try:
            adapter = LoRARequest(body.lora_name, 1, body.lora_path)  # (a cluster names adapters; the id is unused)
            self.front.lora_adapters = await self.front.engine.add_lora(adapter)
        except (ValueError, ClusterError) as e:
            raise ApiError(400, f"load_lora_adapter failed: {safe(e, 2000)}", param="lora_path") from None
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")

    async def unload_lora_adapter(self, request: Request) -> Response:
        """vLLM's POST /v1/unload_lora_adapter {"lora_name"}: requests that name it from then on get 404; those
        running finish with it. The same roles as loading; 400 for a name no engine has."""
        body = await self.front.parse(request, UnloadLoraAdapterRequest)
        try:
            self.front.lora_adapters = await self.front.engine.remove_lora(body.lora_name)
        except (ValueError, ClusterError) as e:
            raise ApiError(400, f"unload_lora_adapter failed: {safe(e, 2000)}", param="lora_name") from None
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")
