"""Engine types <-> baton.v1 messages, in one place so every service converts alike."""
from __future__ import annotations

import math

import grpc

from baton.engine.output_processor import RequestOutput
from baton.engine.requests.sampling_params import SamplingParams
from baton.engine.requests.structured_output import StructuredOutput
from baton.models.audio import AudioInput
from baton.models.multimodal import ImageInput, MediaInput
from baton.v1 import decode_pb2, router_pb2

CONTRACT = SamplingParams()     # baton.v1's value of each field a request leaves unset (engine/sampling_params.py)

FINISH_TO_PROTO = {
    None: router_pb2.FINISH_REASON_UNSPECIFIED,
    "stop": router_pb2.FINISH_REASON_STOP,
    "length": router_pb2.FINISH_REASON_LENGTH,
    "abort": router_pb2.FINISH_REASON_ABORT,
}

# a token-bus chunk's error_code (a grpc status number) -> its StatusCode
STATUS_BY_NUMBER = {code.value[0]: code for code in grpc.StatusCode}


def timeout_ms(seconds: float) -> int:
    """A downstream call's timeout_ms: 0 (none) when the request has no deadline (inf)."""
    return 0 if math.isinf(seconds) else max(1, int(seconds * 1000))


def sampling_from_proto(p: router_pb2.SamplingParams, defaults: dict | None = None) -> SamplingParams:
    """Unset fields take `defaults` (the model's generation config, engine/requests/sampling_params.py),
    else the contract's; range checks are SamplingParams.validate's."""
    d = defaults or {}
    return SamplingParams(
        temperature=p.temperature if p.HasField("temperature") else d.get("temperature", CONTRACT.temperature),
        top_p=p.top_p if p.HasField("top_p") else d.get("top_p", CONTRACT.top_p),
        top_k=p.top_k if p.HasField("top_k") else d.get("top_k", CONTRACT.top_k),
        max_tokens=p.max_tokens if p.HasField("max_tokens") else d.get("max_tokens", CONTRACT.max_tokens),
        stop=list(p.stop),
        stop_token_ids=list(p.stop_token_ids),
        ignore_eos=p.ignore_eos,
        seed=p.seed if p.HasField("seed") else None,
        presence_penalty=p.presence_penalty, frequency_penalty=p.frequency_penalty,
        repetition_penalty=p.repetition_penalty if p.HasField("repetition_penalty") else CONTRACT.repetition_penalty,
        min_p=p.min_p, min_tokens=p.min_tokens, logit_bias=dict(p.logit_bias),
        prior_output_tokens=p.prior_output_tokens,
        logprobs=p.logprobs if p.HasField("logprobs") else None,
        prompt_logprobs=p.prompt_logprobs if p.HasField("prompt_logprobs") else None,
        priority=p.priority,
        speculative=p.speculative if p.HasField("speculative") else CONTRACT.speculative,
        structured=structured_from_proto(p.structured) if p.HasField("structured") else None,
    )


def structured_from_proto(p: router_pb2.StructuredOutput) -> StructuredOutput:
    kind = p.WhichOneof("kind")
    if kind is None:
        raise ValueError("structured is set but empty: set one of json_object, json_schema, regex, choice, grammar")
    if kind == "choice":
        return StructuredOutput.choice(p.choice.choices)
    return StructuredOutput(kind, "" if kind == "json_object" else getattr(p, kind), strict=p.strict)


def structured_to_proto(s: StructuredOutput) -> router_pb2.StructuredOutput:
    p = router_pb2.StructuredOutput(strict=s.strict)
    if s.kind == "json_object":
        p.json_object.SetInParent()
    elif s.kind == "choice":
        p.choice.choices.extend(s.choices)
    else:
        setattr(p, s.kind, s.spec)
    return p


def sampling_to_proto(s: SamplingParams) -> router_pb2.SamplingParams:
    p = router_pb2.SamplingParams(
        temperature=s.temperature, top_p=s.top_p, top_k=s.top_k, max_tokens=s.max_tokens,
        stop=s.stop, stop_token_ids=s.stop_token_ids, ignore_eos=s.ignore_eos,
        presence_penalty=s.presence_penalty, frequency_penalty=s.frequency_penalty, min_p=s.min_p,
        min_tokens=s.min_tokens, logit_bias=s.logit_bias, prior_output_tokens=s.prior_output_tokens,
        priority=s.priority)
    if s.repetition_penalty != 1.0:
        p.repetition_penalty = s.repetition_penalty
    if s.logprobs is not None:
        p.logprobs = s.logprobs
    if s.prompt_logprobs is not None:
        p.prompt_logprobs = s.prompt_logprobs
    if s.seed is not None:
        p.seed = s.seed
    if not s.speculative:
        p.speculative = False
    if s.structured is not None:
        p.structured.CopyFrom(structured_to_proto(s.structured))
    return p


def logprobs_to_proto(entries) -> list[router_pb2.TokenLogprob]:
    """engine TokenLogprob records (None: not computed, sent as NaN) -> their messages."""
    return [router_pb2.TokenLogprob(token_id=0, logprob=math.nan) if e is None else
            router_pb2.TokenLogprob(token_id=e.token_id, logprob=e.logprob,
                                    top=[router_pb2.TopLogprob(token_id=t, logprob=v) for t, v in e.top])
            for e in entries]


def media_from_proto(req) -> list[MediaInput]:
    """A worker request's images (baton.v1.Image) and audio clips (baton.v1.Audio) -> the engine's
    inputs, bytes as the client sent them (a model takes one kind, so the order within it is all)."""
    if any(not image.data for image in req.images):
        raise ValueError("an image of the request has no bytes")
    if any(not clip.data for clip in req.audios):
        raise ValueError("an audio clip of the request has no bytes")
    return ([ImageInput(image.data, image.mime_type) for image in req.images]
            + [AudioInput(clip.data, clip.format) for clip in req.audios])


def chunk_from_output(out: RequestOutput, handover_seconds: float = 0.0) -> decode_pb2.TokenChunk:
    chunk = decode_pb2.TokenChunk(token_ids=out.new_token_ids, text=out.new_text,
                                  finish_reason=FINISH_TO_PROTO[out.finish_reason],
                                  handover_seconds=handover_seconds)
    if out.finished:
        chunk.usage.CopyFrom(router_pb2.Usage(prompt_tokens=out.prompt_tokens,
                                              completion_tokens=out.completion_tokens,
                                              cached_prompt_tokens=out.cached_tokens))
    return chunk
