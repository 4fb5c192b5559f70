"""POST /v1/embeddings: pooling requests through the same admission, cluster and failover as generation."""

from __future__ import annotations

import functools
import uuid

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from infer.client.api.admission import check_length
from infer.client.api.formats import embedding_json
from infer.client.api.front import Front, cancel_on_disconnect
from infer.client.api.jobs import Job
from infer.client.api.schemas import ApiError, EmbeddingRequest
from infer.protocol.sampling import SamplingParams


class Embeddings:
    """POST /v1/embeddings."""

    def __init__(self, front: Front) -> None:
        self.front = front

    async def embeddings(self, request: Request) -> Response:
        """POST /v1/embeddings (OpenAI's shape): one pooling request per input (worker/engine/pooling.py), through the
        same admission, cluster and failover as generation; `dimensions` only for a Matryoshka model (FrontConfig)."""
        body = await self.front.parse(request, EmbeddingRequest)
        tok = await self.front.tokenization(body)
        self._check_dimensions(body.dimensions)
        inputs = body.prompts()
        params = SamplingParams(
            pooling=body.pooling,
            normalize=body.normalize,
            temperature=0,
            max_tokens=1,
            lora_name=self.front.lora_of(body),
        )
        base_id = f"embd-{uuid.uuid4().hex}"
        self.front.admission.reserve(len(inputs), param="input")
        try:
            model = self.front.model_of(body)
            max_len = await self.front.admission.admit(model)
            prompts = await self.front.prompt_token_ids(tok, inputs, max_len, param="input")
            for ids in prompts:
                check_length(len(ids), None, max_len)
            tracker = functools.partial(self.front.metrics.tracker, self.front.metrics_label(body))
            jobs = [
                Job(i, i, ids, params, f"{base_id}-{i}", tracker(), body.timeout, body.priority, model=model)
                for i, ids in enumerate(prompts)
            ]
            await cancel_on_disconnect(request, self.front.run_to_end(jobs))
        finally:
            self.front.admission.release(len(inputs))
        data = [
            {
                "object": "embedding",
                "index": job.index,
                "embedding": embedding_json(job.embedding or [], body.dimensions, body.normalize, body.encoding_format),
            }
            for job in jobs
        ]
        tokens = sum(len(job.prompt_token_ids) for job in jobs)
        return JSONResponse(
            {
                "id": base_id,
                "object": "list",
                "data": data,
                "model": body.model,
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
            }
        )

    def _check_dimensions(self, dimensions: int | None) -> None:
        allowed = self.front.config.matryoshka_dimensions
        if dimensions is None:
            return
        if allowed is None:
            raise ApiError(
                400,
                "dimensions: this model does not support Matryoshka embeddings (its config.json "
                "declares no matryoshka_dimensions / is_matryoshka): the full vector is the only "
                "size",
                param="dimensions",
            )
        if allowed and dimensions not in allowed:
            raise ApiError(
                400,
                f"dimensions: {dimensions} is not among this model's sizes {', '.join(map(str, allowed))}",
                param="dimensions",
            )
