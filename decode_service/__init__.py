"""The decode worker: admits requests whose KV arrives over the KV-transfer channel, runs
them in its continuous decode batch and streams their tokens; also the colocated role
(server.py)."""
