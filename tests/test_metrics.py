"""Metrics move as a request passes through the router and both nodes."""

from __future__ import annotations

import asyncio
import urllib.request

import grpc
import pytest
from cluster import local_cluster, wait_for_no_blocks

from router.client import AsyncClient


def test_metrics_follow_requests(tiny_llama):
    async def scenario():
        async with local_cluster(tiny_llama) as (router, prefills, decodes):
            rm, pm, dm = router.metrics, prefills[0].metrics, decodes[0].metrics
            async with AsyncClient(router.address) as client:
                await client.generate([5, 6, 7, 8], max_tokens=10, ignore_eos=True)
                with pytest.raises(grpc.aio.AioRpcError):
                    await client.generate([5, 6], max_tokens=0)
                stream = client.stream([5, 6, 7], max_tokens=500, ignore_eos=True)
                async for _ in stream:
                    break
                await stream.aclose()
            await wait_for_no_blocks(prefills + decodes)
            await asyncio.sleep(0.2)
            assert rm.sample("pdserve_requests_total", outcome="ok") == 1
            assert rm.sample("pdserve_requests_total", outcome="invalid") == 1
            for _ in range(50):
                if rm.sample("pdserve_requests_total", outcome="cancelled") == 1:
                    break
                await asyncio.sleep(0.05)
            assert rm.sample("pdserve_requests_total", outcome="cancelled") == 1
            for name in (
                "pdserve_request_ttft_seconds",
                "pdserve_request_tpot_seconds",
                "pdserve_request_e2e_seconds",
                "pdserve_request_queue_seconds",
            ):
                assert rm.sample(name) == 1, name
            assert rm.sample("pdserve_generation_tokens_total") == 10
            assert rm.sample("pdserve_prompt_tokens_total") == 4
            assert pm.sample("pdserve_prefill_compute_seconds") == 2  # the cancelled one prefilled too
            # The finished request's transfer; the cancelled one's, if it got that far.
            assert 1 <= dm.sample("pdserve_kv_transfer_seconds", transport="shm") <= 2
            assert dm.sample("pdserve_kv_transfer_bytes", transport="shm") == dm.sample(
                "pdserve_kv_transfer_seconds", transport="shm"
            )
            assert dm.sample("pdserve_engine_step_seconds", role="decode") >= 9
            decodes[0].exporter.refresh()
            assert dm.sample("pdserve_kv_blocks_used", role="decode") == 0
            assert dm.sample("pdserve_kv_blocks_total", role="decode") == 256
            assert dm.sample("pdserve_engine_tokens_total", role="decode", direction="out") >= 9
            port = rm.serve(0, addr="127.0.0.1")
            text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics").read().decode()
            assert 'pdserve_requests_total{outcome="ok"} 1.0' in text
            assert "pdserve_request_ttft_seconds_bucket" in text

    asyncio.run(scenario())


def test_grafana_dashboard_uses_only_exported_metrics():
    import json
    import re
    from pathlib import Path

    from serving.metrics import DEFINITIONS

    dash = json.loads((Path(__file__).parent.parent / "deploy" / "grafana" / "pdserve.json").read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    names = {re.sub(r"_(bucket|count|sum)$", "", n) for e in exprs for n in re.findall(r"pdserve_[a-z0-9_]+", e)}
    assert names and names <= set(DEFINITIONS), names - set(DEFINITIONS)
    documented = (Path(__file__).parent.parent / "docs" / "metrics.md").read_text()
    assert all(name in documented for name in DEFINITIONS)
