"""A 404 lists every route the app has (derived from the app, so a route added later is listed too)."""

from __future__ import annotations

from fastapi.routing import APIRoute
from front_harness import error_of, http, serving

from infer.client.api.app import build_app, route_list
from infer.client.api.config import FrontConfig


def test_a_404_lists_every_route_of_the_app():
    app = build_app(None, None, FrontConfig(served_model_name="tiny"))
    routes = [(method, r.path) for r in app.routes if isinstance(r, APIRoute) for method in r.methods]
    assert ("POST", "/v1/completions") in routes and ("POST", "/v1/update_weights") in routes
    assert sorted(route_list(app)) == sorted(f"{method} {path}" for method, path in routes)
    with serving(None, None) as url:
        status, _, text = http(f"{url}/v1/nothing-here")
    message = error_of(text)["message"]
    assert status == 404 and message.startswith("no route '/v1/nothing-here'; the routes are ")
    assert message.removeprefix("no route '/v1/nothing-here'; the routes are ").split(", ") == route_list(app)
