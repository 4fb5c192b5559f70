"""The front's status for a request the cluster refused by its model: 404 model_not_found (not a 500)."""

from __future__ import annotations

from infer.client.api.errors import request_error
from infer.protocol.messages import Delta


def test_model_not_found_from_the_cluster_is_a_404_naming_the_field():
    text = "the model 'gone' is not served here; it serves 'llama-a', 'qwen-b'"
    error = request_error(Delta.final("r1", "error", text, "model_not_found"))
    assert (error.status, error.code, error.param) == (404, "model_not_found", "model")
    assert error.message == text
