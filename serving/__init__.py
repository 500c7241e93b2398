"""Service plumbing the router, prefill and decode servers share: the gRPC server and its
error mapping, configuration from flags and environment, TLS and tokens, metrics, the
proto <-> engine conversions and process helpers. Torch-free. The workers' runtime, which
owns an engine, is the sub-package `worker/`; the router never imports it."""
