"""The protos: committed stubs match their .proto files, and baton.v1.Router carries the public
contract of ARCHITECTURE.md exactly (names, types, numbers; added fields are allowed)."""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from google.protobuf import descriptor_pb2

from baton.v1 import kvtransfer_pb2, router_pb2
from protos import generate

REPO = Path(__file__).resolve().parents[1]
F = descriptor_pb2.FieldDescriptorProto

# (message, field, number, type, how): how is "", "optional" (proto3 optional), "repeated" or
# "oneof <name>"; a type is a scalar name or the full name of a message / enum.
ROUTER_FIELDS = [
    ("GenerateRequest", "request_id", 1, "string", ""),
    ("GenerateRequest", "text", 2, "string", "oneof input"),
    ("GenerateRequest", "tokens", 3, "baton.v1.TokenIds", "oneof input"),
    ("GenerateRequest", "chat", 4, "baton.v1.Chat", "oneof input"),
    ("GenerateRequest", "sampling", 5, "baton.v1.SamplingParams", ""),
    ("TokenIds", "ids", 1, "uint32", "repeated"),
    ("Chat", "messages", 1, "baton.v1.ChatMessage", "repeated"),
    ("ChatMessage", "role", 1, "string", ""),
    ("ChatMessage", "content", 2, "string", ""),
    ("SamplingParams", "temperature", 1, "float", "optional"),
    ("SamplingParams", "top_p", 2, "float", "optional"),
    ("SamplingParams", "top_k", 3, "int32", "optional"),
    ("SamplingParams", "max_tokens", 4, "uint32", "optional"),
    ("SamplingParams", "stop", 5, "string", "repeated"),
    ("SamplingParams", "stop_token_ids", 6, "uint32", "repeated"),
    ("SamplingParams", "ignore_eos", 7, "bool", ""),
    ("SamplingParams", "seed", 8, "uint64", "optional"),
    ("GenerateResponse", "request_id", 1, "string", ""),
    ("GenerateResponse", "token_ids", 2, "uint32", "repeated"),
    ("GenerateResponse", "text", 3, "string", ""),
    ("GenerateResponse", "finish_reason", 4, "baton.v1.FinishReason", ""),
    ("GenerateResponse", "usage", 5, "baton.v1.Usage", ""),
    ("Usage", "prompt_tokens", 1, "uint32", ""),
    ("Usage", "completion_tokens", 2, "uint32", ""),
    ("Usage", "cached_prompt_tokens", 3, "uint32", ""),
    ("AbortRequest", "request_id", 1, "string", ""),
    ("AbortResponse", "found", 1, "bool", ""),
    ("ModelInfo", "name", 1, "string", ""),
    ("ModelInfo", "architecture", 2, "string", ""),
    ("ModelInfo", "max_model_len", 3, "uint32", ""),
    ("ModelInfo", "vocab_size", 4, "uint32", ""),
    ("ModelInfo", "eos_token_ids", 5, "uint32", "repeated"),
    ("ServerInfo", "workers", 1, "baton.v1.WorkerInfo", "repeated"),
    ("WorkerInfo", "address", 1, "string", ""),
    ("WorkerInfo", "role", 2, "string", ""),
    ("WorkerInfo", "healthy", 3, "bool", ""),
    ("WorkerInfo", "running", 4, "uint32", ""),
    ("WorkerInfo", "waiting", 5, "uint32", ""),
    ("WorkerInfo", "kv_blocks_total", 6, "uint32", ""),
    ("WorkerInfo", "kv_blocks_free", 7, "uint32", ""),
]
ROUTER_EMPTY_MESSAGES = ["GetModelInfoRequest", "GetServerInfoRequest"]
ROUTER_RPCS = [  # (name, input, output, server streaming)
    ("Generate", "GenerateRequest", "GenerateResponse", True),
    ("Abort", "AbortRequest", "AbortResponse", False),
    ("GetModelInfo", "GetModelInfoRequest", "ModelInfo", False),
    ("GetServerInfo", "GetServerInfoRequest", "ServerInfo", False),
]
FINISH_REASONS = {"FINISH_REASON_UNSPECIFIED": 0, "FINISH_REASON_STOP": 1, "FINISH_REASON_LENGTH": 2,
                  "FINISH_REASON_ABORT": 3}


def file_proto(module) -> descriptor_pb2.FileDescriptorProto:
    fdp = descriptor_pb2.FileDescriptorProto()
    module.DESCRIPTOR.CopyToProto(fdp)
    return fdp


ROUTER = file_proto(router_pb2)
MESSAGES = {m.name: m for m in ROUTER.message_type}


def type_name(f: descriptor_pb2.FieldDescriptorProto) -> str:
    if f.type in (F.TYPE_MESSAGE, F.TYPE_ENUM):
        return f.type_name.lstrip(".")
    return F.Type.Name(f.type).removeprefix("TYPE_").lower()


def how(msg: descriptor_pb2.DescriptorProto, f: descriptor_pb2.FieldDescriptorProto) -> str:
    if f.proto3_optional:
        return "optional"
    if f.label == F.LABEL_REPEATED:
        return "repeated"
    if f.HasField("oneof_index"):
        return f"oneof {msg.oneof_decl[f.oneof_index].name}"
    return ""


# -- generated stubs ---------------------------------------------------------------------------------
def test_regenerating_the_stubs_gives_no_diff():
    result = subprocess.run([sys.executable, "-m", "protos.generate", "--check"], cwd=REPO, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr


def test_check_fails_with_a_diff_summary_when_a_stub_is_stale(tmp_path, monkeypatch, capsys):
    shutil.copytree(REPO / "protos" / "baton", tmp_path / "baton")
    stale = tmp_path / "baton" / "v1" / "router_pb2.pyi"
    stale.write_text(stale.read_text().replace("class SamplingParams", "class SamplingParamz"))
    monkeypatch.setattr(generate, "ROOT", tmp_path)
    assert generate.check() == 1
    err = capsys.readouterr().err
    assert "changed   baton/v1/router_pb2.pyi (+1 -1 lines)" in err
    assert "-class SamplingParamz" in err and "+class SamplingParams" in err
    assert generate.write() == 0 and generate.check() == 0            # regenerating repairs it


def test_every_proto_has_committed_stubs_that_import_package_qualified():
    protos = sorted((REPO / "protos" / "baton" / "v1").glob("*.proto"))
    assert {"router.proto", "kvtransfer.proto"} <= {p.name for p in protos}
    for proto in protos:
        stubs = [proto.parent / f"{proto.stem}{suffix}" for suffix in generate.SUFFIXES]
        for stub in stubs:
            assert stub.is_file(), f"{stub.name} is not committed"
            imports = [line for line in stub.read_text().splitlines() if "_pb2" in line and "import" in line]
            assert all(line.startswith("from baton.v1 import ") for line in imports), (stub.name, imports)
        if "service " in proto.read_text():
            assert f"from baton.v1 import {proto.stem}_pb2" in stubs[2].read_text()


# -- the public Router contract ---------------------------------------------------------------------------
def test_router_lives_in_package_baton_v1_as_proto3():
    assert ROUTER.package == "baton.v1" and ROUTER.syntax == "proto3" and ROUTER.name == "baton/v1/router.proto"


@pytest.mark.parametrize("message, name, number, ftype, kind", ROUTER_FIELDS,
                         ids=[f"{m}.{n}" for m, n, *_ in ROUTER_FIELDS])
def test_router_field_has_its_normative_number_and_type(message, name, number, ftype, kind):
    msg = MESSAGES[message]
    fields = {f.name: f for f in msg.field}
    assert name in fields, f"{message}.{name} is missing"
    f = fields[name]
    assert (f.number, type_name(f), how(msg, f)) == (number, ftype, kind)


def test_router_has_its_rpcs_with_their_streaming():
    [service] = [s for s in ROUTER.service if s.name == "Router"]
    methods = {m.name: m for m in service.method}
    for name, request, reply, streams in ROUTER_RPCS:
        m = methods[name]
        assert (m.input_type, m.output_type) == (f".baton.v1.{request}", f".baton.v1.{reply}")
        assert (m.client_streaming, m.server_streaming) == (False, streams)


def test_router_enums_and_empty_requests():
    [finish] = [e for e in ROUTER.enum_type if e.name == "FinishReason"]
    values = {v.name: v.number for v in finish.value}
    assert FINISH_REASONS.items() <= values.items()          # the contract's, as written; grown since by
    assert values == {**FINISH_REASONS, "FINISH_REASON_TOOL_CALLS": 4}     # a chat that ends in tool calls
    for name in ROUTER_EMPTY_MESSAGES:
        assert name in MESSAGES


def test_contract_fields_have_presence_where_the_contract_says_optional():
    sampling = router_pb2.SamplingParams()
    assert not sampling.HasField("seed") and not sampling.HasField("temperature")
    sampling.seed = 0
    assert sampling.HasField("seed")                  # an explicit 0 is distinguishable from unset
    assert router_pb2.GenerateRequest(tokens=router_pb2.TokenIds(ids=[1])).WhichOneof("input") == "tokens"


# -- the internal KV-transfer service ---------------------------------------------------------------------
def test_kvtransfer_push_is_a_bidi_stream_and_handshake_is_unary():
    services = {s.name: {m.name: (m.client_streaming, m.server_streaming) for m in s.method}
                for s in file_proto(kvtransfer_pb2).service}
    assert services == {"KVTransfer": {"Handshake": (False, False), "Push": (True, True)},
                        # the device-direct backend: rendezvous unary, one bidi control stream per pair
                        "KVDirect": {"Connect": (False, False), "Session": (True, True)}}
