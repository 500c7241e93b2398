"""A client container of the compose tests: runs inside a network namespace, reaches the
router by its service name, prints what it got as one JSON line.

    python tests/compose_client.py ask ROUTER            # one gRPC and one OpenAI request
    python tests/compose_client.py load ROUTER N STOP    # N streams in a loop until the file STOP exists
                                                         # (each finished request also appended to STOP.jsonl)
"""
from __future__ import annotations

import json
import sys
import threading
import time
from pathlib import Path

import grpc

from baton.v1 import router_pb2, router_pb2_grpc


def chat(text: str, max_tokens: int) -> router_pb2.GenerateRequest:
    req = router_pb2.GenerateRequest(sampling=router_pb2.SamplingParams(temperature=0, max_tokens=max_tokens))
    req.chat.messages.add(role="user", content=text)
    return req


def generate(stub, req) -> tuple[str, str]:
    text, finish = "", ""
    for r in stub.Generate(req, timeout=120):
        text += r.text
        finish = router_pb2.FinishReason.Name(r.finish_reason) if r.finish_reason else finish
    return text, finish


def ask(router: str) -> dict:
    from openai import OpenAI
    with grpc.insecure_channel(f"{router}:50051") as ch:
        text, finish = generate(router_pb2_grpc.RouterStub(ch), chat("What is the capital of France?", 24))
    client = OpenAI(base_url=f"http://{router}:8000/v1", api_key="unused", timeout=120, max_retries=0)
    model = client.models.list().data[0].id
    reply = client.chat.completions.create(model=model, temperature=0, max_tokens=24,
                                           messages=[{"role": "user", "content": "What is the capital of France?"}])
    return {"grpc": text, "grpc_finish": finish, "openai": reply.choices[0].message.content,
            "openai_finish": reply.choices[0].finish_reason, "model": model}


def load(router: str, streams: int, stop: Path) -> dict:
    results, lock = [], threading.Lock()

    def loop(i: int) -> None:
        with grpc.insecure_channel(f"{router}:50051") as ch:
            stub = router_pb2_grpc.RouterStub(ch)
            n = 0
            while not stop.exists():
                t0 = time.time()
                try:
                    text, finish = generate(stub, chat(f"Count from {i * 100 + n} upwards.", 32))
                    outcome = {"ok": finish in ("FINISH_REASON_STOP", "FINISH_REASON_LENGTH") and bool(text), "finish": finish}
                except grpc.RpcError as exc:
                    outcome = {"ok": False, "error": f"{exc.code().name}: {exc.details()}"}
                with lock:
                    results.append({"stream": i, "start": t0, "end": time.time(), **outcome})
                    with open(f"{stop}.jsonl", "a") as log:
                        log.write(json.dumps(results[-1]) + "\n")
                n += 1

    threads = [threading.Thread(target=loop, args=(i,)) for i in range(streams)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return {"requests": results}


if __name__ == "__main__":
    mode, router = sys.argv[1], sys.argv[2]
    out = ask(router) if mode == "ask" else load(router, int(sys.argv[3]), Path(sys.argv[4]))
    print(json.dumps(out), flush=True)
