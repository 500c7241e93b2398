"""The public front door, `baton.v1.Router` over gRPC: validation, tokenization, worker
registry, routing policies, request lifecycle, retries (server.py is the request path)."""
