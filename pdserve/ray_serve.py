"""`pdserve serve`: deploy the application on a Ray cluster from a Serve config file."""

from __future__ import annotations

import json
import os
import secrets
import shlex
import signal
import stat
import sys
import threading
import time
import urllib.request
from pathlib import Path

from pdserve import serve_config
from pdserve.ray_app import parse_args

SERVE_APPLICATIONS_API = "/api/serve/applications/"


def wait_running(app_names: list[str], timeout_s: float) -> None:
    from ray import serve

    give_up = time.time() + timeout_s
    while True:
        apps = serve.status().applications
        states = {name: apps[name].status if name in apps else "NOT_STARTED" for name in app_names}
        if all(s == "RUNNING" for s in states.values()):
            return
        failed = {n: apps[n].message for n, s in states.items() if s in ("DEPLOY_FAILED", "UNHEALTHY")}
        if failed:
            raise RuntimeError(f"deploy failed: {failed}")
        if time.time() > give_up:
            raise TimeoutError(f"applications not running after {timeout_s:.0f} s: {states}")
        time.sleep(1.0)


# Ray's token authentication (Ray 2.60), as read from its source:
# - A new local cluster (ray.init() without an address) turns it on unless RAY_AUTH_MODE says
#   otherwise (ray/_private/authentication/authentication_token_setup.py: enable_token_auth_by_default),
#   and writes a missing token to ~/.ray/auth_token (generate_and_save_token) with the umask's mode.
# - Every Ray process takes the token from RAY_AUTH_TOKEN, else the file RAY_AUTH_TOKEN_PATH names,
#   else $HOME/.ray/auth_token (C++ AuthenticationTokenLoader::LoadTokenFromSources).
# - The dashboard (ray/dashboard/http_server_head.py, ray/_private/authentication/
#   http_token_authentication.py) wants `Authorization: Bearer <token>` (or X-Ray-Authorization, or
#   the cookie ray-authentication-token) on every path but a few public ones (/, /static/...,
#   /api/authentication_mode, /api/authenticate): 401 without a token, 403 with a wrong one. In a
#   browser the dashboard asks for the token ("Authentication Token Required") and POSTs it to
#   /api/authenticate, which sets that cookie (HttpOnly, 30 days).
def _home_relative(path: Path) -> str:
    """`path` as a user types it in a shell: ~/... under $HOME, quoted where it needs quotes."""
    try:
        return "~/" + shlex.quote(str(path.relative_to(Path.home())))
    except ValueError:
        return shlex.quote(str(path))


def token_source() -> tuple[str, str, Path | None]:
    """Where Ray (in this process's environment) reads the auth token, in Ray's order: a phrase
    naming it, a shell expression that gives the token, and the file (None for the env var)."""
    if os.environ.get("RAY_AUTH_TOKEN"):
        return "the environment variable RAY_AUTH_TOKEN", "$RAY_AUTH_TOKEN", None
    path = Path(os.environ.get("RAY_AUTH_TOKEN_PATH") or Path.home() / ".ray" / "auth_token")
    return _home_relative(path), f"$(cat {_home_relative(path)})", path


def ensure_private_token() -> Path | None:
    """Before a new local cluster: where Ray would create ~/.ray/auth_token itself (token auth on,
    no token anywhere), create it first, owner-only (Ray's own file gets the umask's mode, usually
    world-readable). Returns the file when it made one."""
    if os.environ.get("RAY_AUTH_MODE", "token").lower() != "token":
        return None
    if os.environ.get("RAY_AUTH_TOKEN") or os.environ.get("RAY_AUTH_TOKEN_PATH"):
        return None
    path = Path.home() / ".ray" / "auth_token"
    try:
        if path.read_text().strip():
            return None
    except FileNotFoundError:
        pass
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.fchmod(fd, 0o600)  # an existing empty file keeps its mode otherwise
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32))  # Ray's own format (authentication_token_generator.py)
    from ray._raylet import AuthenticationTokenLoader

    AuthenticationTokenLoader.instance().reset_cache()
    return path


def local_auth_mode() -> str:
    """This process's Ray authentication mode: "disabled", "token" (or "unknown")."""
    from ray._private.authentication.authentication_utils import get_authentication_mode_name
    from ray._raylet import get_authentication_mode

    return get_authentication_mode_name(get_authentication_mode())


def dashboard_auth_mode(url: str, timeout_s: float = 10.0) -> str | None:
    """The cluster's authentication mode, from its dashboard's public /api/authentication_mode."""
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(f"{url}/api/authentication_mode", timeout=timeout_s) as r:
            return json.load(r).get("authentication_mode")
    except (OSError, ValueError):
        return None


def dashboard_lines(url: str, auth_mode: str) -> list[str]:
    """What `pdserve serve` prints about the Ray dashboard: its URL, how to sign in, and a curl
    command to its Serve applications API (the token itself is never printed)."""
    url = url.rstrip("/")
    lines = [f"pdserve serve: Ray dashboard at {url} (Serve tab: deployments and replica counts)"]
    api = f"{url}{SERVE_APPLICATIONS_API}"
    if auth_mode == "disabled":
        return lines + ["  token authentication is off on this cluster: no sign-in; from a shell:", f"  curl {api}"]
    if auth_mode != "token":
        return lines + [
            f"  authentication mode {auth_mode!r}: see https://docs.ray.io/en/latest/ray-security/token-auth.html"
        ]
    where, expr, path = token_source()
    note = ""
    if path is not None and path.exists() and path.stat().st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        note = f"; others can read it: chmod 600 {where}"
    return lines + [
        f"  token authentication is on: the page asks for the token, in {where} "
        f"(`ray get-auth-token` prints it{note}); from a shell:",
        f'  curl -H "Authorization: Bearer {expr}" {api}',
    ]


def connect_error(address: str, error: BaseException) -> str:
    """One line for a failed ray.init(address=...): Ray never turns token auth on by itself for an
    explicit address, so a cluster with token auth refuses a client without RAY_AUTH_MODE=token."""
    cause: BaseException | None = error
    while cause is not None:
        if type(cause).__name__ == "AuthenticationError" or "InvalidAuthToken" in str(cause):
            return (
                f"the Ray cluster at {address} uses token authentication and got no valid token from "
                "this process: set RAY_AUTH_MODE=token, and the cluster's token in ~/.ray/auth_token, "
                "the file RAY_AUTH_TOKEN_PATH names, or RAY_AUTH_TOKEN"
            )
        cause = cause.__cause__ or cause.__context__
    return f"cannot connect to the Ray cluster at {address}: {error}"


def _dashboard_url(context) -> str | None:
    url = getattr(context, "dashboard_url", None)
    if not url:
        return None
    return url if "://" in url else f"http://{url}"


def serve(config_path: str | None, address: str | None, timeout_s: float = 600.0) -> int:
    import ray

    from serving.registry import CALL_TIMEOUT_S, registry

    schema = serve_config.validate(serve_config.load(config_path or serve_config.DEFAULT_CONFIG))
    local = address is None
    if local:
        from pdserve.ray_app import LOCAL_RESOURCES

        made = ensure_private_token()
        if made is not None:
            print(f"pdserve serve: created the Ray auth token in {_home_relative(made)} (owner-only)", flush=True)
        context = ray.init(
            include_dashboard=True, dashboard_host="127.0.0.1", namespace="pdserve", resources=LOCAL_RESOURCES
        )
    else:
        try:
            context = ray.init(address=address, namespace="pdserve")
        except ConnectionError as e:
            print(f"pdserve: error: {connect_error(address, e)}", file=sys.stderr)
            return 1
    try:
        serve_config.deploy(schema)
        wait_running([app.name for app in schema.applications], timeout_s)
        grpc_port = schema.grpc_options.port
        for app in schema.applications:
            if app.import_path != serve_config.PDSERVE_BUILDER:
                continue
            app_args = parse_args(app.args)
            try:
                routers = ray.get(registry(app_args.app_name).snapshot.remote(), timeout=CALL_TIMEOUT_S)["router"]
            except ray.exceptions.GetTimeoutError:  # the registry restarting: the config's port
                routers = []
            example = routers[0] if routers else f"127.0.0.1:{app_args.router.port}"
            print(
                f"pdserve serve: application {app.name!r} is RUNNING\n"
                f"  gRPC through Ray Serve's proxy (on every Ray node): <node>:{grpc_port} with metadata "
                f"application={app.name}\n"
                f'    pdserve generate --addr 127.0.0.1:{grpc_port} --application {app.name} "Hello"\n'
                f"  gRPC on each router replica's own port (no per-message proxy cost): "
                f"{', '.join(routers) or f'<node>:{app_args.router.port}'}\n"
                f'    pdserve generate --addr {example} "Hello"',
                flush=True,
            )
        url = _dashboard_url(context)
        if url is None:
            print("pdserve serve: no Ray dashboard on this cluster", flush=True)
        else:
            mode = (None if local else dashboard_auth_mode(url)) or local_auth_mode()
            print("\n".join(dashboard_lines(url, mode)), flush=True)
        if local:
            print("Ctrl-C stops the application and the local Ray cluster.", flush=True)
            stop = threading.Event()
            for sig in (signal.SIGINT, signal.SIGTERM):
                signal.signal(sig, lambda *_: stop.set())
            stop.wait()
    except (ValueError, RuntimeError, TimeoutError, ray.exceptions.RayError) as e:
        print(f"pdserve: error: {' '.join(str(e).split())[:500]}", file=sys.stderr)  # one line
        return 1
    finally:
        if local:
            from ray import serve as ray_serve

            ray_serve.shutdown()
            ray.shutdown()
    return 0
