"""The running Serve app a study tunes in place, found once: which app serves engine replicas, what they serve, and
the client traffic they recorded. The tuner's command (tuning/search.py), the workload (tuning/workloads.py), the
in-place trials (tuning/inplace.py) and the write-back (tuning/writeback.py) all look the app up here.

Light at import (the tuner's `--help` loads no Ray): Ray Serve and the replicas' deployment (which imports it) are
imported where the cluster is asked.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from serving.engine.config import EngineConfig
from serving.replica.node import Placed, ReplicaPlace
from tuning.errors import UserError
from tuning.options import SearchOptions, Where

if TYPE_CHECKING:
    from serving.engine.traffic import TrafficSummary


@dataclass(frozen=True)
class ServingApp(Placed):
    """A running Serve app with engine replicas: where an in-place study runs."""

    name: str
    replicas: int
    serving: EngineConfig  # what the replicas serve now: the study's base, and what an interruption restores
    places: tuple[ReplicaPlace, ...] = ()  # each replica's node and GPUs, as it reads them on its node


def engine_apps() -> dict[str, Any]:
    """The Serve apps of the connected Ray cluster that run the engine replicas' deployment, by name, with their
    status."""
    from ray import serve

    from serving.replica.control import DEPLOYMENT_NAME

    return {name: app for name, app in serve.status().applications.items() if DEPLOYMENT_NAME in app.deployments}


def named_app(apps: dict[str, Any], app_name: str | None) -> str | None:
    """The app a command means: the one it names, else the only one running engine replicas (None: several or
    none, and it named none)."""
    if app_name is None and len(apps) == 1:
        return next(iter(apps))
    return app_name


def engine_handle(app: str) -> Any:
    """A handle to app `app`'s engine replicas."""
    from ray import serve

    from serving.replica.control import DEPLOYMENT_NAME

    return serve.get_deployment_handle(DEPLOYMENT_NAME, app_name=app)


def find_serving_app(app_name: str | None) -> ServingApp | None:
    """The Serve app (of the connected Ray cluster) whose engine replicas a study can run on, if any;
    LookupError when several could be and `app_name` does not say which."""
    from ray.serve.schema import ReplicaState  # imports ray.serve, which sets its logger to INFO

    from serving.replica.control import DEPLOYMENT_NAME

    logging.getLogger("ray.serve").setLevel(logging.WARNING)  # its handles' "Started <router>" is no news
    apps = engine_apps()
    if app_name is None and len(apps) > 1:
        raise LookupError(f"several Serve apps run engine replicas ({', '.join(sorted(apps))}): pass --app-name")
    app_name = named_app(apps, app_name)
    if app_name is None or app_name not in apps:
        return None
    replicas = apps[app_name].deployments[DEPLOYMENT_NAME].replica_states.get(ReplicaState.RUNNING, 0)
    handle = engine_handle(app_name)
    serving: EngineConfig = handle.served_config.remote().result(timeout_s=120)
    places = tuple(ReplicaPlace.from_dict(p) for p in handle.broadcast("place").results(timeout_s=60))
    return ServingApp(app_name, int(replicas), serving, places)


def serving_app(opts: SearchOptions, find: Callable[[str | None], ServingApp | None] = find_serving_app
                ) -> ServingApp | None:
    """The Serve app an in-place study runs on, or None for offline trials: any app serving engine replicas in
    the connected cluster unless --offline; --in-place or --app-name make finding none an error. `find` looks
    the app up (default: find_serving_app, in the connected Ray cluster)."""
    if opts.where is Where.offline:
        return None
    try:
        app = find(opts.app_name)
    except LookupError as exc:  # several apps and no --app-name
        raise UserError(str(exc)) from exc
    except Exception as exc:  # no Serve in this cluster, or its controller not answering
        if opts.where is Where.in_place:
            raise UserError(f"--in-place: cannot reach a Serve app ({type(exc).__name__}: {exc})") from exc
        return None
    if app is None:
        if opts.where is Where.in_place or opts.app_name is not None:
            named = f"named {opts.app_name!r} " if opts.app_name else ""
            raise UserError(f"no running Serve app {named}with engine replicas to tune in place; start one "
                            "(serve run serving.app:main), or pass --offline")
        return None
    if app.replicas < 1:
        raise UserError(f"Serve app {app.name!r} has no running engine replica (starting, or failed?); retry "
                        "when its /health answers 200, or pass --offline")
    return app


def recorded_traffic(app: str) -> tuple[TrafficSummary, int | None]:
    """The app's client traffic as its replicas recorded it, merged (GET /traffic), and how many replicas
    did not answer."""
    summary, missing = engine_handle(app).all_traffic.remote().result(timeout_s=60)
    return summary, missing
