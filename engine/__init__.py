"""What prefill and decode share: config, scheduling, KV blocks, model runner, sampler,
platforms, and the offline `LLM` API."""
from baton.engine.config import DEFAULT_MODEL, EngineConfig
from baton.engine.requests.sampling_params import SamplingParams
from baton.engine.requests.structured_output import StructuredOutput


def __getattr__(name):
    # torch-heavy pieces load on first use, so `import engine` stays cheap for the router
    if name == "LLM":
        from baton.engine.llm import LLM
        return LLM
    if name == "LLMEngine":
        from baton.engine.llm_engine import LLMEngine
        return LLMEngine
    raise AttributeError(name)


__all__ = ["DEFAULT_MODEL", "EngineConfig", "LLM", "LLMEngine", "SamplingParams", "StructuredOutput"]
