"""Every service knob is a flag with a BATON_* twin, read in one place (serving/options.py),
and docs/configuration.md is the table the parsers make."""
from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

import pytest

from baton.configuration import all_parsers, table
from baton.serving.worker.worker_config import parse_worker_args

REPO = Path(__file__).resolve().parent.parent


def test_the_docs_table_is_what_the_parsers_say():
    assert (REPO / "docs" / "configuration.md").read_text() == table(), \
        "regenerate it: python -m baton.configuration > docs/configuration.md"


def test_every_option_of_every_service_has_an_environment_twin():
    for command, p in all_parsers().items():
        for action in p._actions:
            if action.option_strings and action.dest not in ("help", argparse.SUPPRESS) and command != "baton generate":
                assert getattr(action, "env", "").startswith("BATON_"), (command, action.option_strings)


def test_a_flag_beats_its_variable_which_beats_the_default(monkeypatch):
    assert parse_worker_args("decode", []).max_waiting == 1024
    monkeypatch.setenv("BATON_MAX_WAITING", "7")
    monkeypatch.setenv("BATON_PREFIX_CACHING", "false")
    cfg = parse_worker_args("decode", [])
    assert cfg.max_waiting == 7 and cfg.engine.enable_prefix_caching is False
    assert parse_worker_args("decode", ["--max-waiting", "9", "--prefix-caching"]).max_waiting == 9


def test_a_variable_that_does_not_parse_names_itself(monkeypatch):
    monkeypatch.setenv("BATON_MAX_WAITING", "lots")
    with pytest.raises(SystemExit, match="BATON_MAX_WAITING='lots' does not parse as int"):
        parse_worker_args("decode", [])


def test_vllm_habits_are_understood():
    cfg = parse_worker_args("decode", ["--colocated", "--tensor-parallel-size", "2"])
    assert cfg.role == "colocated" and cfg.engine.tp_size == 2


@pytest.mark.parametrize("command", ["serve", "router", "prefill", "decode", "generate", "bench"])
def test_help_answers_at_once_without_importing_torch(command):
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, "-X", "importtime", "-m", "baton", command, "--help"], capture_output=True,
                         text=True, timeout=60)
    took = time.monotonic() - t0
    assert out.returncode == 0 and "usage: baton" in out.stdout
    if command != "bench":                       # the harness's help lists its benchmarks' own flags
        imported = {line.rsplit("|", 1)[-1].strip() for line in out.stderr.splitlines() if "|" in line}
        assert "torch" not in imported, "--help imported torch"
        assert took < 5, f"baton {command} --help took {took:.1f}s"


# -- --config FILE.yaml: flag > file > BATON_* > default -------------------------------------------
def _config(tmp_path, text: str) -> str:
    path = tmp_path / "baton.yaml"
    path.write_text(text)
    return str(path)


def test_a_config_file_sits_between_the_flags_and_the_variables(tmp_path, monkeypatch):
    path = _config(tmp_path, "max-num-seqs: 8\nprefix_caching: false\nmax-waiting: 5\n")
    monkeypatch.setenv("BATON_MAX_NUM_SEQS", "4")          # the file beats the variable
    monkeypatch.setenv("BATON_GRACE", "7")                 # a variable the file leaves alone still counts
    cfg = parse_worker_args("decode", ["--config", path])
    assert (cfg.engine.max_num_seqs, cfg.engine.enable_prefix_caching, cfg.max_waiting, cfg.grace_seconds) == \
        (8, False, 5, 7.0)
    cfg = parse_worker_args("decode", [f"--config={path}", "--max-num-seqs", "2", "--prefix-caching"])
    assert (cfg.engine.max_num_seqs, cfg.engine.enable_prefix_caching) == (2, True)    # flags beat the file
    monkeypatch.setenv("BATON_CONFIG", path)              # the file's own variable
    assert parse_worker_args("decode", []).max_waiting == 5


@pytest.mark.parametrize("text, says", [
    ("max-num-seqs: lots\n", "max-num-seqs='lots' does not parse as int"),
    ("no-such-flag: 1\n", "'no-such-flag' is no setting of baton decode"),
    ("- max-num-seqs\n", "must map flag names to values"),
    ("max-num-seqs: [1\n", "not valid YAML"),
    ("kv-backend: carrier-pigeon\n", "kv-backend='carrier-pigeon' is not one of grpc, direct"),
])
def test_a_config_file_that_does_not_parse_says_where(tmp_path, capsys, text, says):
    path = _config(tmp_path, text)
    with pytest.raises(SystemExit) as exc:
        parse_worker_args("decode", ["--config", path])
    said = f"{exc.value.code} {capsys.readouterr().err}"      # sys.exit(message) or the parser's error
    assert exc.value.code not in (0, None) and says in said and f"--config {path}" in said


def test_a_missing_config_file_is_named(capsys):
    with pytest.raises(SystemExit):
        parse_worker_args("decode", ["--config", "/no/such/baton.yaml"])
    assert "--config /no/such/baton.yaml: No such file" in capsys.readouterr().err


def test_baton_serve_passes_the_files_settings_on_as_flags(tmp_path):
    from baton.launcher import build_parser, passed_on
    from baton.router.config import build_parser as router_parser
    path = _config(tmp_path, "served-model-name: [a, b]\nmax-inflight: 3\nmax-num-seqs: 6\n")
    args = build_parser().parse_args(["--config", path])
    assert passed_on(args, router_parser()) == ["--served-model-name", "a", "b", "--max-inflight", "3"]
    assert "--config" not in passed_on(args, router_parser())      # each child gets flags, not the file


# -- vLLM's spellings -------------------------------------------------------------------------------
def test_vllm_spellings_of_flags_mean_the_same():
    from baton.router.config import parse_router_args
    cfg = parse_worker_args("decode", ["Qwen/Qwen3-0.6B", "--no-enable-prefix-caching", "--dtype", "auto"])
    assert cfg.engine.model == "Qwen/Qwen3-0.6B" and cfg.engine.enable_prefix_caching is False
    assert cfg.engine.dtype is None                          # auto: the platform's
    assert parse_worker_args("decode", ["--dtype", "half"]).engine.dtype == "float16"
    assert parse_worker_args("decode", ["--dtype", "bf16"]).engine.dtype == "bfloat16"
    router = parse_router_args(["--colocated", "w:1", "--served-model-name", "a", "b,c"])
    assert router.served_model_name == ["a", "b", "c"]
    from baton.serving.worker.worker_config import build_parser
    args = build_parser("decode").parse_args(["--ssl-certfile", "c.pem", "--ssl-keyfile", "k.pem", "--ssl-ca-certs",
                                              "ca.pem"])
    assert (args.tls_cert, args.tls_key, args.tls_ca) == ("c.pem", "k.pem", "ca.pem")


def test_the_model_given_twice_differently_is_refused(capsys):
    with pytest.raises(SystemExit):
        parse_worker_args("decode", ["Qwen/Qwen3-0.6B", "--model", "tiny-llama"])
    assert "the model is given twice" in capsys.readouterr().err


def test_served_model_names_from_the_variable_split_on_spaces_or_commas(monkeypatch):
    from baton.router.config import parse_router_args
    monkeypatch.setenv("BATON_SERVED_MODEL_NAME", "a b,c")
    assert parse_router_args(["--colocated", "w:1"]).served_model_name == ["a", "b", "c"]


@pytest.mark.parametrize("argv, says", [
    (["--port", "8000", "--http-port", "8000"], "--port (gRPC) and --http-port (the OpenAI API) are both port 8000"),
    (["--port", "9000", "--metrics-port", "9000"], "--port (gRPC) and --metrics-port are both port 9000"),
])
def test_a_router_given_one_port_twice_is_refused(argv, says, capsys):
    from baton.router.config import parse_router_args
    with pytest.raises(SystemExit):
        parse_router_args(["--colocated", "w:1", *argv])
    assert says in capsys.readouterr().err


def test_a_worker_given_one_port_twice_is_refused(capsys):
    with pytest.raises(SystemExit):
        parse_worker_args("decode", ["--port", "50061", "--kv-port", "50061"])
    assert "are both port 50061" in capsys.readouterr().err


@pytest.mark.parametrize("how", ["flag", "file"])
def test_the_router_takes_no_device_and_says_whose_flag_it_is(how, tmp_path, capsys):
    from baton.router.config import parse_router_args
    argv = ["--device", "cpu"] if how == "flag" else ["--config", _config(tmp_path, "device: cpu\n")]
    with pytest.raises(SystemExit):
        parse_router_args(["--colocated", "w:1", *argv])
    assert "device: the router runs no model; give --device to the prefill and decode workers" in \
        capsys.readouterr().err
