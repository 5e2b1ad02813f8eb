"""The built app's routes, in-process on a stand-in engine (no model, no server process): every
route declares its access class where it is defined, the classes are the ones clients and load
balancers rely on, the keys are checked as declared, and /get_server_info shows only its
allowlist."""

from __future__ import annotations

import dataclasses
import json
import re
import types

import pytest
from fastapi import FastAPI
from fastapi.routing import APIRoute
from fastapi.testclient import TestClient

from chunkserve.config.engine import EngineArgs
from chunkserve.entrypoints.args import ServerArgs
from chunkserve.entrypoints.server import sglang_api
from chunkserve.entrypoints.server.access import Access, AccessRouters, include_routers
from chunkserve.entrypoints.server.app import build_app

API_KEY = "user-key"
ADMIN_KEY = "admin-key"
# what a load balancer or Prometheus polls, and the dashboard's page (its data is the admin key's)
OPEN = {"/health", "/server_info", "/ping", "/version", "/metrics", "/dashboard"}
ADMIN = {"/reset_prefix_cache", "/flush_cache", "/debug/steps", "/debug/check", "/debug/kv_cache_blocks",
         "/export_request", "/import_request"}


def stand_in_engine() -> types.SimpleNamespace:
    """What building the app and the routes below read of AsyncLLM."""
    info = types.SimpleNamespace(model_name="tiny", max_model_len=128, cpu_threads={"threads": 1},
                                 max_num_batched_tokens=64)
    return types.SimpleNamespace(tokenizer=None, info=info, is_running=True, num_unread_aborts=0,
                                 shutdown=lambda: None, observers=[])


def stand_in_metrics() -> types.SimpleNamespace:
    return types.SimpleNamespace(observe_frontend=lambda unread_aborts: None, render=lambda: b"")


def app_with(engine_args: EngineArgs | None = None, **server_args) -> FastAPI:
    args = ServerArgs(**{"api_key": API_KEY, **server_args})
    return build_app(stand_in_engine(), stand_in_metrics(), ["tiny"], args, engine_args or EngineArgs())


async def empty() -> dict:
    return {}


def access_of(app: FastAPI) -> dict[str, Access]:
    return {route.path: route.access for route in app.routes if isinstance(route, APIRoute)}


def test_every_route_declares_its_access_class():
    app = app_with()
    docs = {app.openapi_url, app.docs_url, app.redoc_url, app.swagger_ui_oauth2_redirect_url}
    for route in app.routes:
        if isinstance(route, APIRoute):
            assert isinstance(getattr(route, "access", None), Access), route.path
        else:  # FastAPI's own pages: they need the API key, as any path without a route
            assert route.path in docs, route
    assert set(app.openapi()["paths"]) <= set(access_of(app))


def test_the_open_and_admin_routes_are_the_polled_and_the_server_wide_ones():
    access = access_of(app_with())
    assert {path for path, declared in access.items() if declared in (Access.OPEN, Access.METRICS)} == OPEN
    assert {path for path, declared in access.items() if declared is Access.ADMIN} == ADMIN
    assert access["/metrics"] is Access.METRICS and access["/dashboard/events"] is Access.DASHBOARD
    assert {"/v1/completions", "/v1/chat/completions", "/generate", "/tokenize", "/get_server_info"} <= {
        path for path, declared in access.items() if declared is Access.KEY}


def test_a_route_without_an_access_class_is_refused():
    app = FastAPI()

    @app.get("/forgotten")
    async def forgotten():
        return {}

    with pytest.raises(ValueError, match="/forgotten"):
        include_routers(app, [], protect_metrics=False)


def test_a_path_declared_twice_with_different_classes_is_refused():
    routers = AccessRouters()
    routers.open.get("/twice")(empty)
    routers.admin.post("/twice")(empty)
    with pytest.raises(ValueError, match="/twice"):
        include_routers(FastAPI(), [routers], protect_metrics=False)


@pytest.mark.parametrize("protect", [False, True])
def test_metrics_is_open_unless_protected(protect):
    app = FastAPI()
    routers = AccessRouters()
    routers.metrics.get("/metrics")(empty)
    assert include_routers(app, [routers], protect_metrics=protect) == {
        "/metrics": Access.KEY if protect else Access.OPEN}


def test_the_keys_guard_the_routes_as_declared():
    with TestClient(app_with(admin_api_key=ADMIN_KEY)) as http:
        assert http.get("/version").status_code == 200 and http.get("/health").status_code == 200
        refused = http.get("/get_server_info")
        assert refused.status_code == 401 and refused.json()["error"]["type"] == "authentication_error"
        assert refused.headers["www-authenticate"] == "Bearer"
        user = {"Authorization": f"Bearer {API_KEY}"}
        assert http.get("/debug/steps", headers=user).status_code == 401  # the API key opens no admin route
        assert http.get("/no-such-route").status_code == 401  # a path without a route needs the key too
        assert http.get("/no-such-route", headers=user).status_code == 404


@pytest.mark.parametrize("protect", [False, True])
def test_prometheus_scrapes_without_a_key_unless_metrics_are_protected(protect):
    with TestClient(app_with(protect_metrics=protect)) as http:
        assert http.get("/metrics").status_code == (401 if protect else 200)
        assert http.get("/metrics", headers={"Authorization": f"Bearer {API_KEY}"}).status_code == 200


def test_admin_routes_are_404_without_an_admin_key():
    with TestClient(app_with()) as http:
        response = http.post("/flush_cache", headers={"Authorization": f"Bearer {API_KEY}"})
        assert response.status_code == 404 and "--admin-api-key" in response.json()["error"]["message"]


def test_get_server_info_shows_the_settings_without_the_keys():
    with TestClient(app_with(EngineArgs(model="tiny.gguf"), admin_api_key=ADMIN_KEY)) as http:
        info = http.get("/get_server_info", headers={"Authorization": f"Bearer {API_KEY}"}).json()
    assert info["model"] == "tiny.gguf" and info["max_model_len"] == 128 and info["cpu_threads"] == {"threads": 1}
    assert info["dtype"] == EngineArgs().dtype and info["served_model_name"] is None
    assert info["deterministic"] is False
    assert "api_key" not in info and "admin_api_key" not in info
    assert API_KEY not in json.dumps(info) and ADMIN_KEY not in json.dumps(info)


def test_a_setting_off_the_allowlist_is_never_shown():
    @dataclasses.dataclass
    class ServerArgsWithANewFlag(ServerArgs):
        storage_token: str = "s3cret"

    shown = sglang_api.shown_settings(EngineArgs(), ServerArgsWithANewFlag(api_key=API_KEY))
    assert "storage_token" not in shown and "s3cret" not in json.dumps(shown)
    assert "api_key" not in shown and API_KEY not in json.dumps(shown)


def test_the_allowlist_names_only_real_settings():
    """A renamed flag must be renamed here too, or it silently leaves /get_server_info."""
    assert set(sglang_api.SHOWN_ENGINE_ARGS) <= {field.name for field in dataclasses.fields(EngineArgs)}
    assert set(sglang_api.SHOWN_SERVER_ARGS) <= {field.name for field in dataclasses.fields(ServerArgs)}
    assert not {"api_key", "admin_api_key"} & set(sglang_api.SHOWN_ENGINE_ARGS + sglang_api.SHOWN_SERVER_ARGS)


def first_event(http: TestClient, app: FastAPI, headers: dict | None = None) -> tuple[int, dict | None]:
    """/dashboard/events' status and, when it streams, its first snapshot (the feed is then closed,
    which ends the stream)."""
    with http.stream("GET", "/dashboard/events", headers=headers or {}) as response:
        if response.status_code != 200:
            return response.status_code, None
        assert response.headers["content-type"].startswith("text/event-stream")
        line = next(line for line in response.iter_lines() if line.startswith("data: "))
        app.state.dashboard_feed.close()
        return 200, json.loads(line[6:])


def test_the_dashboards_data_needs_the_admin_key_unless_opened_by_flag():
    admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
    app = app_with()
    with TestClient(app) as http:  # no admin key: like every admin route, not there
        assert first_event(http, app) == (404, None)
        assert first_event(http, app, {"Authorization": f"Bearer {API_KEY}"}) == (404, None)
    app = app_with(admin_api_key=ADMIN_KEY)
    with TestClient(app) as http:
        assert first_event(http, app)[0] == 401
        assert first_event(http, app, {"Authorization": f"Bearer {API_KEY}"})[0] == 401  # the API key opens nothing
        status, snapshot = first_event(http, app, admin)
        assert status == 200 and snapshot["token_budget"] == 64 and snapshot["steps"] == []
        bad = http.get("/dashboard/events", params={"window": 0}, headers=admin)
        assert bad.status_code == 400 and "window" in bad.json()["error"]["message"]
    app = app_with(dashboard_without_auth=True)
    with TestClient(app) as http:
        assert first_event(http, app)[0] == 200


def test_the_dashboard_page_is_open_and_fetches_nothing_from_elsewhere():
    with TestClient(app_with(admin_api_key=ADMIN_KEY)) as http:
        page = http.get("/dashboard")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    html = page.text
    assert 'id="steps"' in html and "/dashboard/events" in html
    # no script, style, image or font from another origin: every URL in the page is this server's
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", html) and "@import" not in html
    assert "sessionStorage" in html and "?key=" not in html  # the key is kept in the tab and sent as a header
