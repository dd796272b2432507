"""The pyscore gRPC server (`python -m server` in a checkout; installed, `pyscore-server`): pyscore.v1.Scorer on
grpc.aio with continuous batching, health and reflection. It converts protobuf to pyscore.types and back; the
engine knows nothing of gRPC."""
