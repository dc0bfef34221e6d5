"""python -m prefill_node --model NAME [options]: one prefill node process."""

from kvtransfer import transports
from prefill_node.config import PrefillConfig
from prefill_node.server import PrefillNode
from serving.process import node_entry

ENTRY = node_entry(
    "prefill_node",
    "One prefill node: computes prompts' KV and first tokens, and serves the KV.",
    PrefillConfig,
    transports.sender_options(),
    PrefillNode,
)

if __name__ == "__main__":
    ENTRY.main()
