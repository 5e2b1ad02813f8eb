"""Who may call a route, declared where the route is defined.

Each API module defines its routes on `AccessRouters`: one `APIRouter` per access class
(`routers.admin.post("/flush_cache")`), whose routes carry that class. `include_routers` puts
them in the app and returns each path's class for ApiKeyMiddleware, which checks keys before a
body is read. A route added any other way has no class, and `include_routers` refuses the app.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable

from fastapi import APIRouter, FastAPI
from fastapi.routing import APIRoute


class Access(enum.Enum):
    OPEN = "open"  # what a router, a load balancer or a health check polls (vLLM leaves these open too)
    KEY = "key"  # the API key, when one is set
    ADMIN = "admin"  # the admin key; answered 404 while the server has none
    METRICS = "metrics"  # Prometheus' scrape: open, or the API key's with --protect-metrics
    DASHBOARD = "dashboard"  # /dashboard's live data: the admin key's, or open with --dashboard-without-auth


class _AccessRoute(APIRoute):
    access: Access


class OpenRoute(_AccessRoute):
    access = Access.OPEN


class KeyRoute(_AccessRoute):
    access = Access.KEY


class AdminRoute(_AccessRoute):
    access = Access.ADMIN


class MetricsRoute(_AccessRoute):
    access = Access.METRICS


class DashboardRoute(_AccessRoute):
    access = Access.DASHBOARD


class AccessRouters:
    """One module's routes, by access class: `open`, `key`, `admin`, `metrics`, `dashboard`."""

    def __init__(self) -> None:
        self.open = APIRouter(route_class=OpenRoute)
        self.key = APIRouter(route_class=KeyRoute)
        self.admin = APIRouter(route_class=AdminRoute)
        self.metrics = APIRouter(route_class=MetricsRoute)
        self.dashboard = APIRouter(route_class=DashboardRoute)

    def routes(self) -> list[_AccessRoute]:
        return [route for router in (self.open, self.key, self.admin, self.metrics, self.dashboard)
                for route in router.routes]


def include_routers(app: FastAPI, modules: Iterable[AccessRouters], protect_metrics: bool,
                    open_dashboard: bool = False) -> dict[str, Access]:
    """Add every module's routes to `app`; each path's access class (METRICS resolved by
    `protect_metrics`, DASHBOARD by `open_dashboard`). A ValueError if the app has an API route
    without a class, or a path with two classes."""
    access: dict[str, Access] = {}
    for module in modules:
        for route in module.routes():
            # The route itself, as its router built it (every parameter it was declared with kept),
            # rather than include_router, so that app.routes lists each route (recent FastAPI keeps
            # an included router as one nested entry). The routers have no prefix: paths are final.
            app.router.routes.append(route)
            declared = route.access
            if declared is Access.METRICS:
                declared = Access.KEY if protect_metrics else Access.OPEN
            elif declared is Access.DASHBOARD:
                declared = Access.OPEN if open_dashboard else Access.ADMIN
            if access.setdefault(route.path, declared) is not declared:
                raise ValueError(f"{route.path} is declared both {access[route.path].value} and {declared.value}")
    if undeclared := [route.path for route in app.routes if isinstance(route, APIRoute)
                      and not isinstance(route, _AccessRoute)]:
        raise ValueError(f"routes without an access class (define them on AccessRouters): {', '.join(undeclared)}")
    return access
