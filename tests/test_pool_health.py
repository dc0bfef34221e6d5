"""The router's health checks against a real gRPC node on a socket: a node that answers late is
kept (a busy machine), a node that answers no check for `unresponsive_s` is taken out (hung), and
a node that refuses is taken out after `failure_threshold` checks whatever `unresponsive_s` is."""

from __future__ import annotations

import asyncio

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from pdserve_api import common_pb2, nodes_pb2_grpc
from router.pool import EndpointPool


class Node(nodes_pb2_grpc.PrefillNodeServicer):
    """A prefill node's health and GetLoad, answering after `delay_s` (longer than the check's 1 s
    deadline: a hung node, or one too busy to answer in time)."""

    def __init__(self):
        self.delay_s = 0.0

    async def GetLoad(self, request, context):
        await asyncio.sleep(self.delay_s)
        return common_pb2.NodeLoad()


class SlowHealth(health.aio.HealthServicer):
    def __init__(self, node: Node):
        super().__init__()
        self.node = node

    async def Check(self, request, context):
        await asyncio.sleep(self.node.delay_s)
        return health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.SERVING)


async def serve(node: Node) -> tuple[grpc.aio.Server, str]:
    server = grpc.aio.server()
    nodes_pb2_grpc.add_PrefillNodeServicer_to_server(node, server)
    health_pb2_grpc.add_HealthServicer_to_server(SlowHealth(node), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, f"127.0.0.1:{port}"


def test_late_answers_keep_a_node_and_silence_or_refusal_takes_it_out():
    async def scenario():
        node = Node()
        server, address = await serve(node)
        pool = EndpointPool("prefill", [address], check_interval_s=0.1, unresponsive_s=3600)
        try:
            await pool.check_all()
            assert [e.address for e in pool.healthy()] == [address]
            node.delay_s = 3.0  # past the 1 s deadline of every check
            for _ in range(3):
                await pool.check_all()
            assert pool.healthy(), "a node that answers late is busy, not gone"
            await pool.check(pool.endpoints[0])  # the check after a failed request, too
            assert pool.healthy()

            pool.unresponsive_s = 0.5  # silent for longer than this since its last answer: hung
            await pool.check_all()
            await pool.check_all()
            assert not pool.healthy()

            node.delay_s = 0.0
            await pool.check_all()
            assert pool.healthy(), "back once a check passes"

            pool.unresponsive_s = 3600
            await server.stop(0)  # refuses: out after failure_threshold checks, however patient
            await pool.check_all()
            await pool.check_all()
            assert not pool.healthy()
        finally:
            await pool.close()
            await server.stop(0)

    asyncio.run(scenario())


def test_closing_a_pool_with_refreshes_in_flight_leaves_no_task_error():
    """`pdserve up` shutdowns printed `Task exception was never retrieved ... UsageError: Channel
    is closed`: a load refresh still running when its channel closed."""

    async def scenario():
        errors = []
        asyncio.get_running_loop().set_exception_handler(lambda loop, context: errors.append(context))
        node = Node()
        server, address = await serve(node)
        pool = EndpointPool("prefill", [address], check_interval_s=0.05)
        await pool.start()
        node.delay_s = 0.5  # the refreshes and the next checks are in flight when the pool closes
        refreshes = [pool.refresh(pool.endpoints[0]) for _ in range(3)]
        await asyncio.sleep(0.1)
        await pool.close()
        pool.refresh(pool.endpoints[0])  # a request that ends after the router stopped its pools
        await asyncio.sleep(0.6)
        del refreshes, pool  # a task's unretrieved exception is reported when it is collected
        import gc

        gc.collect()
        await server.stop(0)
        return errors

    assert asyncio.run(scenario()) == []


def test_a_node_removed_while_a_check_is_in_flight_does_not_cancel_the_checker():
    """update() removes a node (it died; pdserve up restarts it elsewhere) while a check on it is in
    flight: closing its channel then raised CancelledError in whoever awaited the check, a request
    migrating off that node, which then hung. The channel stays open until idle for a grace period."""

    async def scenario():
        silent = await asyncio.start_server(lambda reader, writer: None, "127.0.0.1", 0)  # accepts, never answers
        address = f"127.0.0.1:{silent.sockets[0].getsockname()[1]}"
        pool = EndpointPool("decode", [address], check_interval_s=1.0)
        e = pool.endpoints[0]
        checking = asyncio.ensure_future(pool.check(e))
        await asyncio.sleep(0.2)
        await pool.update([])
        await checking  # its deadline passes: no CancelledError
        assert pool.endpoints == [] and pool.retired == [e]
        await pool.check(e)  # out of the pool: not checked again
        await pool._close_retired(grace_s=0)
        assert pool.retired == []
        await pool.close()
        silent.close()

    asyncio.run(scenario())
