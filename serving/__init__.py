"""The serving layer: what the nodes and the router share, below them and above the engine and
the KV transport. One gRPC server skeleton, the wire conversions, metrics, the process entry point
and launcher, Ray replica set-up, and the one place options are turned into command lines and
Serve config sections (options.py)."""
