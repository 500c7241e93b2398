"""A user's mistake on the public interfaces, met as a new user meets it: `baton generate`, `baton
role`, `baton elastic`, `baton serve` and the servers' --host, the offline `LLM`. Each is one line
naming the flag (or the argument) at fault, exit 2, no traceback; nothing is sent or started."""
from __future__ import annotations

import pytest

NOWHERE = "127.0.0.1:1"         # nothing listens there: a check that let a request through would fail to connect


def refused(main, argv: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "Traceback" not in err, err
    return err


@pytest.mark.parametrize("flags, says", [
    (["--seed", "-1"], "--seed -1: must be in [0, 18446744073709551615]"),
    (["--max-tokens", "-3"], "--max-tokens -3: must be in [1, 4294967295]"),
    (["--top-k", "99999999999"], "--top-k 99999999999: must be in"),
    (["--timeout", "0"], "--timeout must be > 0"),
    (["--timeout", "-1"], "--timeout must be > 0"),
    (["--chat", "--raw"], "--raw: not allowed with argument --chat"),
    (["--addr", "127.0.0.1:99999"], "--addr 127.0.0.1:99999: the port must be in [1, 65535]"),
])
def test_generate_refuses_a_bad_flag_value_naming_the_flag(flags, says, capsys):
    from baton.client import main
    argv = ["hi", *flags] if "--addr" in flags else ["hi", "--addr", NOWHERE, *flags]
    assert says in refused(main, argv, capsys)


@pytest.mark.parametrize("timeout", ["-5", "0", "1e7"])
def test_role_refuses_a_timeout_it_cannot_send(timeout, capsys):
    from baton.client import role_main
    err = refused(role_main, ["127.0.0.1:2", "decode", "--addr", NOWHERE, "--timeout", timeout], capsys)
    assert "--timeout must be in (0, 4294967] seconds" in err


@pytest.mark.parametrize("text, says", [
    ("{}", "not a plan written by `baton plan --output` (it has no 'workloads')"),
    ("garbage", "not a plan written by `baton plan --output` (not JSON:"),
    (None, "No such file or directory"),
])
def test_elastic_says_what_is_wrong_with_the_plan_file(text, says, tmp_path, capsys):
    from baton.elastic import main
    path = tmp_path / "plan.json"
    if text is not None:
        path.write_text(text)
    err = refused(main, ["--plan", str(path), "--addr", NOWHERE, "--once"], capsys)
    assert f"--plan {path}: {says}" in err
