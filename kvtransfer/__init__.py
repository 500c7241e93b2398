"""The KV-transfer channel: compatibility handshake, layout, and backends that move a
request's KV blocks from a prefill worker to a decode worker."""
