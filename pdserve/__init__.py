"""The top-level commands: `pdserve up`, `serve`, `bench`, `generate`, `generate-offline`,
`colocated`; the Ray application builder and autoscaling policies that Serve configs name."""
