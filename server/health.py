"""grpc.health.v1.Health with List: grpcio-health-checking's asyncio servicer implements Check and Watch, while
the service it advertises (and reflection describes) also has List, which would answer UNIMPLEMENTED."""

from __future__ import annotations

from typing import Any

from grpc_health.v1 import health, health_pb2


class HealthServicer(health.aio.HealthServicer):
    def serving(self, service: str = "") -> bool:
        """Whether `service` ("" = the server) is SERVING now (what the HTTP /health answers)."""
        return self._server_status.get(service) == health_pb2.HealthCheckResponse.SERVING

    async def List(self, request: health_pb2.HealthListRequest, context: Any) -> health_pb2.HealthListResponse:
        """The status of every service this server reports on ("" is the server as a whole)."""
        # _server_status is the upstream servicer's own table, which Check reads: the same answers by construction
        statuses = {name: health_pb2.HealthCheckResponse(status=status) for name, status in self._server_status.items()}
        return health_pb2.HealthListResponse(statuses=statuses)
