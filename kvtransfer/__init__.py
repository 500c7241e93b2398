"""The KV-transfer channel: a request's KV blocks from a prefill worker to a decode worker.

registry.py (every backend's spec: name, preference, pairing rule, services, flags, failure
policy; the one place backend names live, torch-free for the router) -> backend.py (the
interface every backend implements: KVSender.open -> OutgoingTransfer.piece ... done;
KVReceiver) -> handshake.py (layout and secret, before any backend moves a byte) -> layout.py
(what both ends must agree on) -> receiver.py (the decode side's registry of expected
transfers: exactly one callback each) -> one folder per backend (grpc_backend/,
direct_backend/, nixl_backend/, memory_backend/). The blocks <-> bytes packing is the engine's
(engine/runner/kv_blocks.py); peer_auth.py proves a shared secret; grpc_options.py sets the channel's
limits.
"""
