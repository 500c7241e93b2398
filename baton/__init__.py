"""Baton: LLM serving with prefill and decode disaggregated across devices.

The offline API, as in vLLM:

    from baton import LLM, SamplingParams
    llm = LLM()                                  # the embedded smollm2-135m-instruct
    outs = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=32))

Every part of the system lives under this one namespace: `baton.v1` (the generated gRPC
stubs), `baton.router`, `baton.prefill_service`, `baton.decode_service`, `baton.kvtransfer`,
`baton.models`, `baton.engine`, `baton.serving` and `baton.benchmarks`; README.md's layout
table says what each holds.
"""
from __future__ import annotations

__version__ = "0.2.0"


def __getattr__(name: str):
    # loaded on first use: `import baton.router` (or `baton --help`) must not import torch
    if name == "LLM":
        from baton.engine.llm import LLM
        return LLM
    if name == "SamplingParams":
        from baton.engine.requests.sampling_params import SamplingParams
        return SamplingParams
    if name == "StructuredOutput":
        from baton.engine.requests.structured_output import StructuredOutput
        return StructuredOutput
    raise AttributeError(f"module 'baton' has no attribute {name!r}")


__all__ = ["LLM", "SamplingParams", "StructuredOutput", "__version__"]
