"""Generated gRPC/protobuf code for pdserve's services (from proto/pdserve_api/*.proto).

Do not edit: run `python scripts/gen_proto.py`. The package is not called `proto` because that
import name belongs to proto-plus, which ray[serve] installs.
"""
