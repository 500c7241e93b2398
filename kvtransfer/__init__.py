"""The KV-transfer channel: a request's KV blocks from a prefill worker to a decode worker.

layout.py (what both ends must agree on) -> blocks.py (blocks <-> bytes) -> backend.py (the
sender / receiver interface) -> receiver.py (the decode side's registry of expected
transfers) -> grpc_backend.py (the portable backend; chunk_codec.py, grpc_options.py) ->
bench.py (loopback throughput against a plain TCP copy).
"""
