"""Who may talk to the internal ports: mutual TLS and a shared token. Certificates are made here
with a throwaway CA."""

from __future__ import annotations

import asyncio
import datetime
import ipaddress

import grpc
import pytest
from cluster import local_cluster, wait_for_no_blocks
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvtransfer.security import Security
from pdserve_api import common_pb2, nodes_pb2, nodes_pb2_grpc
from router.client import AsyncClient
from serving.grpc_server import GrpcServer


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def make_pki(tmp_path, tag: str) -> dict[str, str]:
    """A CA and a certificate for 127.0.0.1 usable as server and client; PEM file paths."""
    now = datetime.datetime.now(datetime.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = (
        x509.CertificateBuilder()
        .subject_name(_name(f"{tag}-ca"))
        .issuer_name(_name(f"{tag}-ca"))
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(hours=1))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name(f"{tag}-node"))
        .issuer_name(ca.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(hours=1))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")]),
            critical=False,
        )
        .add_extension(
            x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False
        )
        .sign(ca_key, hashes.SHA256())
    )
    files = {"ca": tmp_path / f"{tag}-ca.pem", "cert": tmp_path / f"{tag}-cert.pem", "key": tmp_path / f"{tag}-key.pem"}
    files["ca"].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    files["cert"].write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    files["key"].write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    return {k: str(v) for k, v in files.items()}


async def _load(security: Security, node) -> common_pb2.NodeLoad:
    stub = nodes_pb2_grpc.PrefillNodeStub if hasattr(node, "leases") else nodes_pb2_grpc.DecodeNodeStub
    async with security.channel(node.address) as channel:
        return await stub(channel).GetLoad(common_pb2.LoadRequest(), timeout=5)


def test_mutual_tls_on_the_internal_ports(tiny_llama, tmp_path):
    pki, other = make_pki(tmp_path, "cluster"), make_pki(tmp_path, "intruder")
    cluster_tls = Security(pki["cert"], pki["key"], pki["ca"], require_client_cert=True)

    async def scenario():
        async with local_cluster(tiny_llama, security=cluster_tls, kv_transport="grpc") as (router, prefills, decodes):
            async with AsyncClient(router.address) as client:  # the router holds a cluster certificate
                result = await client.generate([5, 6, 7, 8], max_tokens=6, ignore_eos=True)
                assert len(result.token_ids) == 6 and result.timings["kv_transport"] == "grpc"
            assert (await _load(cluster_tls, prefills[0])).num_total_blocks > 0
            for intruder in (
                Security(ca=pki["ca"]),  # TLS, but no client certificate
                Security(other["cert"], other["key"], pki["ca"]),  # a certificate from another CA
                Security(),
            ):  # plaintext
                for node in prefills + decodes:
                    with pytest.raises(grpc.aio.AioRpcError) as err:
                        await _load(intruder, node)
                    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
            # A forged KV push: a decode request naming a KV plane outside the cluster. The decode
            # node checks the peer's certificate before reading a byte, so nothing is decoded.
            fake = GrpcServer(security=Security(other["cert"], other["key"], other["ca"]))
            fake.add(
                nodes_pb2_grpc.add_KVPlaneServicer_to_server,
                nodes_pb2_grpc.KVPlaneServicer(),
                nodes_pb2.DESCRIPTOR.services_by_name["KVPlane"],
            )
            await fake.start()
            layout = decodes[0].layout.to_proto()
            async with cluster_tls.channel(decodes[0].address) as channel:
                call = nodes_pb2_grpc.DecodeNodeStub(channel).Decode(
                    nodes_pb2.DecodeRequest(
                        request_id="forged",
                        prompt_token_ids=[5, 6],
                        output_token_ids=[7],
                        sampling=common_pb2.SamplingParams(max_tokens=3),
                        kv=nodes_pb2.KVSource(
                            lease_id="x",
                            kv_address=fake.address,
                            layout=layout,
                            num_tokens=2,
                            block_ids=[0],
                            num_bytes=decodes[0].layout.num_bytes(2),
                        ),
                    )
                )
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    async for _ in call:
                        pass
                assert err.value.code() == grpc.StatusCode.UNAVAILABLE
            await fake.stop(0)
            await wait_for_no_blocks(prefills + decodes)

    asyncio.run(scenario())


def test_mutual_tls_on_the_tcp_kv_plane(tiny_llama, tmp_path):
    from kvtransfer.base import KVTransferError
    from kvtransfer.tcp import TcpReader

    pki, other = make_pki(tmp_path, "cluster"), make_pki(tmp_path, "intruder")
    cluster_tls = Security(pki["cert"], pki["key"], pki["ca"], require_client_cert=True)

    async def scenario():
        async with local_cluster(tiny_llama, security=cluster_tls, kv_transport="tcp") as (router, prefills, decodes):
            async with AsyncClient(router.address) as client:
                result = await client.generate([5, 6, 7, 8], max_tokens=6, ignore_eos=True)
                assert len(result.token_ids) == 6 and result.timings["kv_transport"] == "tcp-layerwise"
            # An intruder that even knows a live lease and its key reads nothing without a
            # certificate of the cluster's CA.
            async with cluster_tls.channel(prefills[0].address) as channel:
                reply = await nodes_pb2_grpc.PrefillNodeStub(channel).Prefill(
                    nodes_pb2.PrefillRequest(
                        request_id="r", prompt_token_ids=[5, 6, 7], sampling=common_pb2.SamplingParams(max_tokens=4)
                    )
                )
            dst = decodes[0].llm.kv_cache
            for intruder in (Security(ca=pki["ca"]), Security(other["cert"], other["key"], pki["ca"]), Security()):
                with pytest.raises(KVTransferError):
                    await TcpReader(intruder, timeout_s=5).read(reply.kv, dst, decodes[0].layout, [0])
            await TcpReader(cluster_tls).read(reply.kv, dst, decodes[0].layout, [0])  # the cluster's own: fine
            await prefills[0].release(reply.kv.lease_id)
            await wait_for_no_blocks(prefills + decodes)

    asyncio.run(scenario())


def test_tls_without_a_ca_on_the_tcp_kv_plane(tiny_llama, tmp_path):
    """--tls-cert/--tls-key without --tls-ca: the TCP plane trusts the system's roots, as the gRPC
    plane does (its reader raised TypeError at start), so a private CA's certificate is refused
    with a clear error and nothing is read."""
    from kvtransfer.base import KVTransferError
    from kvtransfer.tcp import TcpReader

    pki = make_pki(tmp_path, "cluster")
    cluster_tls = Security(pki["cert"], pki["key"], pki["ca"], require_client_cert=True)
    no_ca = TcpReader(Security(pki["cert"], pki["key"]), timeout_s=5)

    async def scenario():
        async with local_cluster(tiny_llama, security=cluster_tls, kv_transport="tcp") as (router, prefills, decodes):
            async with cluster_tls.channel(prefills[0].address) as channel:
                reply = await nodes_pb2_grpc.PrefillNodeStub(channel).Prefill(
                    nodes_pb2.PrefillRequest(
                        request_id="r", prompt_token_ids=[5, 6, 7], sampling=common_pb2.SamplingParams(max_tokens=4)
                    )
                )
            with pytest.raises(KVTransferError, match="certificate"):
                await no_ca.read(reply.kv, decodes[0].llm.kv_cache, decodes[0].layout, [0])
            await prefills[0].release(reply.kv.lease_id)
            await wait_for_no_blocks(prefills + decodes)

    asyncio.run(scenario())


def test_shared_token(tiny_llama):
    token = Security(token="s3cret")

    async def scenario():
        async with local_cluster(tiny_llama, security=token) as (router, prefills, decodes):
            async with AsyncClient(router.address) as client:
                assert len((await client.generate([5, 6, 7], max_tokens=4, ignore_eos=True)).token_ids) == 4
            for wrong in (Security(), Security(token="guess")):
                for node in prefills + decodes:
                    with pytest.raises(grpc.aio.AioRpcError) as err:
                        await _load(wrong, node)
                    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
                    async with wrong.channel(node.address) as channel:  # probes still work
                        reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
                        assert reply.status == health_pb2.HealthCheckResponse.SERVING
            async with grpc.aio.insecure_channel(prefills[0].address) as channel:
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    async for _ in nodes_pb2_grpc.KVPlaneStub(channel).PullKV(nodes_pb2.PullKVRequest(lease_id="x")):
                        pass
                assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED

    asyncio.run(scenario())


def test_public_port_with_tls_and_token(tiny_llama, tmp_path):
    from router.config import RouterConfig
    from router.server import Router

    pki = make_pki(tmp_path, "public")
    (tmp_path / "token").write_text("client-token\n")

    async def scenario():
        async with local_cluster(tiny_llama) as (plain, prefills, decodes):
            router = Router(
                str(tiny_llama),
                [p.address for p in prefills],
                [d.address for d in decodes],
                RouterConfig(port=0),
                public_security=Security.from_files(pki["cert"], pki["key"], token_file=str(tmp_path / "token")),
            )
            await router.start()
            try:
                good = Security.from_files(ca=pki["ca"], token_file=str(tmp_path / "token"))
                async with AsyncClient(router.address, security=good) as client:
                    assert len((await client.generate([5, 6], max_tokens=3, ignore_eos=True)).token_ids) == 3
                async with AsyncClient(router.address, security=Security(ca=pki["ca"])) as client:
                    with pytest.raises(grpc.aio.AioRpcError) as err:
                        await client.generate([5, 6], max_tokens=3)
                    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
            finally:
                await router.stop(0)

    asyncio.run(scenario())


def test_shm_regions_outside_pdserve_are_never_opened():
    from kvtransfer.shm import REGION_NAME

    assert REGION_NAME.fullmatch("pdserve-kv-123-0a1b2c3d")
    for bad in ("../../etc/passwd", "pdserve-kv-1-0a1b2c3d/../../x", "sem.foo", "pdserve-kv-x-0a1b2c3d", ""):
        assert not REGION_NAME.fullmatch(bad)


def test_a_lease_is_found_only_with_its_access_key_on_the_grpc_planes(tiny_llama):
    """An attacker on the internal port who learned a lease id (logs, a shared router) but not its
    access key can neither pull its KV over gRPC nor release it: NOT_FOUND, as for no lease; the
    holder of the KVSource then reads it and releases it."""
    from cluster import used_blocks

    from kvtransfer.layout import KVLayout

    async def scenario():
        async with local_cluster(tiny_llama) as (router, prefills, decodes):
            channel = grpc.aio.insecure_channel(prefills[0].address)
            stub = nodes_pb2_grpc.PrefillNodeStub(channel)
            reply = await stub.Prefill(
                nodes_pb2.PrefillRequest(
                    prompt_token_ids=[5, 6, 7, 8, 9], sampling=common_pb2.SamplingParams(max_tokens=3)
                )
            )
            kv, plane = reply.kv, nodes_pb2_grpc.KVPlaneStub(channel)
            expect = KVLayout.from_proto(kv.layout).to_proto()
            for key in ("", "0" * 32):
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    async for _ in plane.PullKV(
                        nodes_pb2.PullKVRequest(lease_id=kv.lease_id, expect=expect, access_key=key)
                    ):
                        pass
                assert err.value.code() == grpc.StatusCode.NOT_FOUND
                released = await stub.ReleaseKV(nodes_pb2.ReleaseKVRequest(lease_id=kv.lease_id, access_key=key))
                assert not released.released and used_blocks(prefills[0]) > 0
            pulled = [
                c
                async for c in plane.PullKV(
                    nodes_pb2.PullKVRequest(lease_id=kv.lease_id, expect=expect, access_key=kv.access_key)
                )
            ]
            assert sum(len(c.data) for c in pulled) == pulled[0].header.num_bytes
            assert (
                await stub.ReleaseKV(nodes_pb2.ReleaseKVRequest(lease_id=kv.lease_id, access_key=kv.access_key))
            ).released
            await wait_for_no_blocks(prefills)
            await channel.close()

    asyncio.run(scenario())


def test_a_release_while_a_read_pins_the_lease_frees_the_blocks_only_after_the_read():
    """ReleaseKV racing a read in flight (the TCP plane's threads pin a lease while they send its
    blocks): the lease takes no new read at once, and is handed back for freeing only once the
    read unpins it, never under it."""
    from kvtransfer.lease import LeaseTable

    leases = LeaseTable(ttl_s=60)
    lease = leases.add("r", [3, 4], 8, 0)
    assert leases.pin(lease.lease_id, lease.access_key) is lease
    assert leases.pop(lease.lease_id, lease.access_key) is None  # pinned: not freed yet
    assert leases.pin(lease.lease_id, lease.access_key) is None  # but no new read
    assert leases.pop_expired() == []
    leases.unpin(lease)
    assert leases.pop_expired() == [lease] and lease.released and len(leases) == 0
