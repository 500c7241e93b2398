"""Layers the models compose: fused projections, norms, rotary, embeddings, attention."""
