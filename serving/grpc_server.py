"""A grpc.aio server with what every pdserve server carries: the standard health service,
server reflection, explicit message size limits.

Health: the overall status ("") and each service's say whether the server takes work
(`set_serving`: a draining node, a router without a healthy node in a pool); `liveness` is
SERVING for as long as the server runs, for probes that should restart a hung process but not
one that is merely unable to serve."""

from __future__ import annotations

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from kvtransfer.security import MESSAGE_OPTIONS, NONE, SERVER_KEEPALIVE_OPTIONS, Security

LIVENESS = "liveness"
SERVER_OPTIONS = [*MESSAGE_OPTIONS, *SERVER_KEEPALIVE_OPTIONS, ("grpc.so_reuseport", 0)]


class GrpcServer:
    def __init__(self, host: str = "127.0.0.1", port: int = 0, security: Security = NONE, any_port_if_taken=False):
        """any_port_if_taken: `port` is a preference (a Serve replica's: on Kubernetes each pod has
        its fixed port, on one host a second replica takes any other)."""
        self.server = grpc.aio.server(options=SERVER_OPTIONS, interceptors=security.interceptors())
        self.health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self.service_names = [health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME]
        self.host = host
        creds = security.server_credentials()
        target = f"{host}:{port}"
        self.port = self._bind(target, creds)
        if self.port == 0 and port != 0 and any_port_if_taken:
            target = f"{host}:0"
            self.port = self._bind(target, creds)
        if self.port == 0:
            raise OSError(f"could not bind {target} (in use, or not an address of this host)")

    def _bind(self, target: str, creds) -> int:
        """The bound port, or 0 where gRPC could not bind (a port in use, an address not here)."""
        try:
            return self.server.add_secure_port(target, creds) if creds else self.server.add_insecure_port(target)
        except RuntimeError:  # grpc's word for a port in use or an address not on this host
            return 0

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def add(self, add_to_server, servicer, descriptor) -> None:
        """Registers a servicer (add_FooServicer_to_server, instance, file DESCRIPTOR's service)."""
        add_to_server(servicer, self.server)
        self.service_names.append(descriptor.full_name)

    async def start(self) -> None:
        reflection.enable_server_reflection(self.service_names, self.server)
        await self.server.start()
        for name in self.service_names + ["", LIVENESS]:
            await self.health.set(name, health_pb2.HealthCheckResponse.SERVING)

    async def set_serving(self, serving: bool, names: list[str] | None = None) -> None:
        """Sets these services' health (default: all of them and ""; never `liveness`)."""
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in (self.service_names + [""]) if names is None else names:
            await self.health.set(name, status)

    async def stop(self, grace: float | None = 1.0) -> None:
        await self.server.stop(grace)
