"""Service plumbing the router, prefill and decode servers share: the gRPC server and its
error mapping, configuration from flags and environment, TLS and tokens, metrics, the
proto <-> engine conversions, the worker base class and process helpers. Torch-free
except `worker` (it owns an engine)."""
