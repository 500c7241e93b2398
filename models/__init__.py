"""Model definitions (Llama, Qwen2, Qwen3), their layers, weight loading and model sources.

Import the submodule you need: `source` (where a model comes from; torch-free, the router
uses it), `registry` (architecture -> class, and `build_model`), `loader` (weights),
`forward_context` (what a forward pass needs from the runner).
"""
