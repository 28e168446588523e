"""Generated protobuf and gRPC stubs of `protos/tandem/v1` (made by `make protos`, never committed)."""
