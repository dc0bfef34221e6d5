"""python -m decode_node --model NAME [options]: one decode node process."""

from decode_node.config import DecodeConfig
from decode_node.server import DecodeNode
from kvtransfer import transports
from serving.process import node_entry

ENTRY = node_entry(
    "decode_node",
    "One decode node: reads each sequence's KV from its prefill node and decodes it in the continuous batch.",
    DecodeConfig,
    transports.reader_options(),
    DecodeNode,
)

if __name__ == "__main__":
    ENTRY.main()
