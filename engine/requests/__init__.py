"""What a request is, before the engine holds it: sampling parameters, structured output, the
tokenizer and detokenizer, length limits, log-probability records. Torch-free: the router and the
services' fronts import these, and nothing else of the engine."""
