"""The prefill worker: runs prompts in continuous batches and hands their KV to the decode
worker the router chose (server.py)."""
