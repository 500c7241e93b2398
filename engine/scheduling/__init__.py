"""Policy above the tensors: a request's sequence (and its images), the block manager (paged KV,
prefix cache), the scheduler and its policies. Torch-free, so it can be tested and simulated on
any machine."""
