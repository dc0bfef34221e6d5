"""Loading, strictly validating and deploying a Ray Serve config file.

Serve's own schema drops keys it does not know (a misspelled `max_replicsa` would be silently
ignored), so every mapping is also checked against the model that reads it, recursively.
"""

from __future__ import annotations

import os
import typing
from pathlib import Path

import yaml
from pydantic import BaseModel

DEFAULT_CONFIG = Path(__file__).resolve().parent.parent / "deploy" / "serve_config.yaml"
PDSERVE_BUILDER = "pdserve.ray_app:build_app"
PLANNER_POLICY = "pdserve.autoscaling:PlannerPolicy"


def _models_in(annotation) -> list[type[BaseModel]]:
    """The pydantic models an annotation can hold (through Optional, Union, List, ...)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for arg in typing.get_args(annotation) for m in _models_in(arg)]


def unknown_keys(value, model: type[BaseModel], path: str = "") -> list[str]:
    """Paths of the keys in `value` (a mapping read by `model`) that `model` would drop."""
    if not isinstance(value, dict):
        return []
    fields = model.model_fields
    names = set(fields) | {f.alias for f in fields.values() if f.alias}
    found = [f"{path}{key}" for key in value if key not in names]
    for key, item in value.items():
        if key not in fields:
            continue
        for sub in _models_in(fields[key].annotation):
            items = item if isinstance(item, list) else [item]
            for i, element in enumerate(items):
                where = f"{path}{key}[{i}]." if isinstance(item, list) else f"{path}{key}."
                found += unknown_keys(element, sub, where)
            break
    return found


def load(path: str | Path = DEFAULT_CONFIG) -> dict:
    text = Path(path).read_text()
    config = yaml.safe_load(text)
    if not isinstance(config, dict):
        raise ValueError(f"{path}: a Serve config must be a mapping")
    return config


def validate(config: dict):
    """Returns the ServeDeploySchema, or raises ValueError naming every unknown key and every
    invalid pdserve application argument."""
    from ray.serve.schema import ServeDeploySchema

    from pdserve.ray_app import parse_args

    bad = unknown_keys(config, ServeDeploySchema)
    if bad:
        raise ValueError(f"unknown keys in the Serve config (Serve would silently drop them): {bad}")
    schema = ServeDeploySchema.model_validate(config)
    for app in schema.applications:
        if app.import_path == PDSERVE_BUILDER:
            try:
                parse_args(app.args)
                _check_planner_policy(app.autoscaling_policy or {})
            except ValueError as e:
                raise ValueError(f"application {app.name!r}: {e}") from None
    return schema


def _check_planner_policy(policy: dict) -> None:
    """The planner's policy built here first: Serve's controller builds it where a bad argument or
    a missing profile would leave the application on its deployments' policies, unsaid. (The
    profile's path must also exist on the Ray head, where the controller runs.)"""
    if policy.get("policy_function") != PLANNER_POLICY:
        return
    from pdserve.autoscaling import PlannerPolicy

    try:
        PlannerPolicy(**policy.get("policy_kwargs", {}))
    except (OSError, TypeError, KeyError) as e:
        raise ValueError(f"autoscaling_policy {PLANNER_POLICY}: {e}") from None


# Serve's controller gives a starting proxy 5 s to say it is ready, three times, then kills it and
# starts another; on two busy cores a proxy's imports alone took longer (seen: `pdserve serve` died
# with ActorDiedError after 15 s). Where pdserve starts Serve, the controller gets a longer window,
# unless the operator set one.
PROXY_READY_ENV = "RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S"
PROXY_READY_S = "60"


def deploy(schema) -> None:
    """Deploys the applications on the connected Ray cluster declaratively, as `serve deploy` and
    KubeRay do: unchanged deployments keep their replicas; a replica-count change only adds or
    removes replicas. A proxy killed while it started (its controller starts another) is waited
    for by the caller's wait for RUNNING, not raised."""
    from ray.exceptions import ActorDiedError
    from ray.serve._private.api import serve_start

    def start():
        return serve_start(
            http_options=schema.http_options.model_dump(),
            proxy_location=schema.proxy_location,
            grpc_options=schema.grpc_options.model_dump(),
            global_logging_config=schema.logging_config,
            controller_options={
                "runtime_env": {"env_vars": {PROXY_READY_ENV: os.environ.get(PROXY_READY_ENV, PROXY_READY_S)}}
            },
        )

    try:
        client = start()
    except ActorDiedError:  # the controller runs now: this connects to it without waiting for proxies
        client = start()
    client.deploy_apps(schema)
