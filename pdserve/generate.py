"""`pdserve generate`: ask a pdserve router, streaming the answer as it arrives."""

from __future__ import annotations

import json
import sys

import grpc

from router.client import Client, Completion


def stream_answer(
    address: str,
    prompt: str,
    chat: bool = True,
    as_json: bool = False,
    timeout: float | None = None,
    out=sys.stdout,
    metadata: list[tuple[str, str]] | None = None,
    security=None,
    **sampling,
) -> Completion:
    """Streams the answer's text to `out` (or one JSON object at the end); raises grpc.RpcError,
    after ending any text already streamed with a newline."""
    result = Completion()
    request = {"messages": [{"role": "user", "content": prompt}]} if chat else {"prompt": prompt}
    from kvtransfer.security import NONE

    with Client(address, timeout=timeout, metadata=metadata, security=security or NONE) as client:
        try:
            for part in client.stream(**request, **sampling):
                result.add(part)
                if not as_json:
                    out.write(part.text)
                    out.flush()
        except grpc.RpcError:
            if result.text and not as_json:  # the caller's error message starts on a line of its own
                out.write("\n")
                out.flush()
            raise
    if as_json:
        out.write(
            json.dumps(
                {
                    "text": result.text,
                    "token_ids": result.token_ids,
                    "finish_reason": result.finish_reason,
                    "usage": result.usage,
                    "timings": result.timings,
                }
            )
            + "\n"
        )
    else:
        out.write("\n")
    return result
