"""The KV-transfer channel: a request's KV blocks from a prefill worker to a decode worker.

backend.py (the interface every backend implements: KVSender.open -> OutgoingTransfer.piece
... done; KVReceiver) -> layout.py (what both ends must agree on, checked in the handshake)
-> receiver.py (the decode side's registry of expected transfers: exactly one callback each)
-> one folder per backend (grpc_backend/, direct_backend/, memory_backend/) -> factory.py
(which classes a backend's name means). The blocks <-> bytes packing is the engine's
(engine/kv_blocks.py); peer_auth.py proves a shared secret; grpc_options.py sets the channel's
limits.
"""
