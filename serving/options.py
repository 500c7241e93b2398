"""Every knob of the Baton services, read in one place: command-line flags, each with a
BATON_* environment twin (`--max-waiting` is also `BATON_MAX_WAITING`). The flag wins over
the variable, the variable over the default; `--help` shows both, and docs/configuration.md
lists them all in one table generated from the parsers themselves:

    python -m baton.configuration > docs/configuration.md   (a test keeps the two in step)

Config objects (`WorkerConfig`, `RouterConfig`, `EngineConfig`) are built from the parsed
flags and validated once; nothing below reads the environment. (The table itself is made by
`baton.configuration`, at the top, since it needs every command's parser.)
"""
from __future__ import annotations

import argparse
import os
import sys

TRUE = ("1", "true", "yes", "on")
FALSE = ("0", "false", "no", "off", "")


def env_name(flag: str) -> str:
    return "BATON_" + flag.lstrip("-").upper().replace("-", "_")


def flag(p, *names: str, default=None, type=str, help: str, env: str | None = None, hidden: bool = False,
         **kw) -> argparse.Action:
    """Add an option whose default comes from its environment variable when that is set.

    `type=bool` makes a switch (`--x` / `--no-x`); everything else takes a value. Help text
    gets the default and the variable appended. A variable that does not parse stops the
    program with a message naming it. `hidden`: a flag for tests and fault injection, left out
    of `--help` (a user reading it meets only what serves them) and shown by `--help-all`."""
    env = env or env_name(names[0])
    raw = os.environ.get(env)
    if type is bool:
        value = default if raw is None else _parse_bool(env, raw)
        action = p.add_argument(*names, action=argparse.BooleanOptionalAction, default=value, help=help, **kw)
    else:
        value = default if raw is None else _parse(env, raw, type, kw.get("choices"))
        action = p.add_argument(*names, default=value, type=type, help=help, **kw)
    action.env = env
    action.plain_help = help if default is None and "unset" in help else f"{help} (default: {_shown(default)})"
    action.help = f"{action.plain_help[:-1]}; env {env})" if action.plain_help.endswith(")") and \
        action.plain_help != help else f"{help} (env {env})"
    if hidden:
        _hide(p, action)
    return action


def _hide(p, action: argparse.Action) -> None:
    action.hidden_help, action.help = action.help, argparse.SUPPRESS
    help_all = p._option_string_actions.get("--help-all")      # a group shares its parser's table
    if help_all is not None:
        help_all.help = "this help with the flags for tests and fault injection too"


class _HelpAll(argparse.Action):
    """`--help-all`: the help with the hidden flags in it."""

    def __init__(self, option_strings, dest=None, **kw):
        super().__init__(option_strings, argparse.SUPPRESS, nargs=0, default=argparse.SUPPRESS, help=argparse.SUPPRESS)

    def __call__(self, parser, namespace, values, option_string=None):
        for action in parser._actions:
            if getattr(action, "hidden_help", None):
                action.help = action.hidden_help
        parser.print_help()
        parser.exit()


def _parse_bool(env: str, raw: str) -> bool:
    if raw.strip().lower() in TRUE:
        return True
    if raw.strip().lower() in FALSE:
        return False
    sys.exit(f"baton: {env}={raw!r} is not a switch value: use 1/0, true/false, yes/no")


def _parse(env: str, raw: str, type, choices):
    try:
        value = type(raw)
    except (TypeError, ValueError) as exc:
        sys.exit(f"baton: {env}={raw!r} does not parse as {getattr(type, '__name__', type)}: {exc}")
    if choices is not None and value not in choices:
        sys.exit(f"baton: {env}={raw!r} is not one of {', '.join(map(str, choices))}")
    return value


def _shown(default) -> str:
    if default is None or default == "":
        return "unset"
    if isinstance(default, bool):
        return "on" if default else "off"
    return str(default)


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Our help strings already carry their default; keep the choices and the wording as written."""

    def _get_help_string(self, action: argparse.Action) -> str:
        return action.help or ""


class Parser(argparse.ArgumentParser):
    """A bad flag is one line (what is wrong), not a usage block longer than the screen."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def parser(prog: str, description: str, usage: str | None = None) -> argparse.ArgumentParser:
    p = Parser(prog=prog, description=description, formatter_class=HelpFormatter, usage=usage or f"{prog} [flags]")
    p.add_argument("--help-all", action=_HelpAll)     # listed in --help once a hidden flag exists
    return p


def option_rows(commands: dict[str, argparse.ArgumentParser]) -> list[tuple[str, str, str, str]]:
    """(flags, environment variable, help, commands taking it) for every option, once each."""
    rows: dict[tuple[str, str, str], list[str]] = {}
    for command, p in commands.items():
        for action in p._actions:
            if not action.option_strings or action.dest == "help" or isinstance(action, _HelpAll):
                continue
            text = " ".join((getattr(action, "plain_help", None) or action.help or "").split())
            if getattr(action, "hidden_help", None):
                text += " [not in --help; --help-all shows it]"
            key = (", ".join(action.option_strings), getattr(action, "env", "") or "", text)
            rows.setdefault(key, []).append(command.removeprefix("baton "))
    return [(*key, ", ".join(cmds)) for key, cmds in rows.items()]


def markdown(commands: dict[str, argparse.ArgumentParser]) -> str:
    lines = ["# Configuration", "",
             "Every service option, generated from the parsers by `python -m baton.configuration`",
             "(do not edit by hand). Each flag's environment variable sets its default (what",
             "docker-compose and Kubernetes use); the flag, when given, wins. `baton <command> --help`",
             "shows the same, but for the flags marked TEST ONLY, which only `--help-all` lists.", "",
             "| flag | environment | what it does (default) | commands |", "| --- | --- | --- | --- |"]
    for flags, env, text, cmds in option_rows(commands):
        lines.append(f"| `{flags}` | {f'`{env}`' if env else ''} | {text.replace('|', '/')} | {cmds} |")
    lines += ["", "Variables without a flag: `BATON_KV_SECRET` (the shared KV secret itself; a flag would show it "
              "in the process list, so use it or `--kv-secret-file`).", ""]
    return "\n".join(lines)
