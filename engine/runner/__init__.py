"""The model runner and its parts, where the tensors are: weights, the KV cache, step inputs,
dispatch, graphs, the sampler and what runs before it, an EAGLE-3 draft head's passes. Below it
only the platforms (engine/platforms/) and the models."""
