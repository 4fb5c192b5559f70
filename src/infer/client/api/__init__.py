"""The OpenAI-compatible HTTP front: schemas (request bodies), app (routes), metrics, server (uvicorn, infer-api)."""
