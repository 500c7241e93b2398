"""Every knob of the Baton services, read in one place: command-line flags, each with a
BATON_* environment twin (`--max-waiting` is also `BATON_MAX_WAITING`), and `--config FILE.yaml`
holding any of them by their long name (`max-num-seqs: 8`). A flag wins over the file, the file
over the variable, the variable over the default; `--help` shows them, and docs/configuration.md
lists them all in one table generated from the parsers themselves:

    python -m baton.configuration > docs/configuration.md   (a test keeps the two in step)

Config objects (`WorkerConfig`, `RouterConfig`, `EngineConfig`) are built from the parsed
flags and validated once; nothing below reads the environment. (The table itself is made by
`baton.configuration`, at the top, since it needs every command's parser.) The variables are
read through baton/environment.py, the one module that touches the environment.
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import MISSING, fields
from pathlib import Path
from types import SimpleNamespace

from baton import environment

TRUE = ("1", "true", "yes", "on")
FALSE = ("0", "false", "no", "off", "")


def flag(p, *names: str, default=None, type=str, help: str, hidden: bool = False, **kw) -> argparse.Action:
    """Add an option whose default comes from its environment variable (its twin, named after
    its first name: `--max-waiting`, BATON_MAX_WAITING) when that is set.

    `type=bool` makes a switch (`--x` / `--no-x`); everything else takes a value. Help text
    gets the default and the variable appended. A variable that does not parse stops the
    program with a message naming it. `hidden`: a flag for tests and fault injection, left out
    of `--help` (a user reading it meets only what serves them) and shown by `--help-all`."""
    env = environment.twin(names[0])
    raw = environment.get(env)
    if type is bool:
        value = default if raw is None else _parse_bool(env, raw)
        action = p.add_argument(*names, action=argparse.BooleanOptionalAction, default=value, help=help, **kw)
    elif kw.get("nargs") in ("+", "*"):             # a list: the variable's items apart by spaces or commas
        value = default if raw is None else [_parse(env, v, type, kw.get("choices"))
                                             for v in raw.replace(",", " ").split()]
        action = p.add_argument(*names, default=value, type=type, help=help, **kw)
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


def defaults(config: type) -> SimpleNamespace:
    """The field defaults of the config dataclass `config`, by field name (a slots dataclass keeps
    none on the class): a flag takes its default from here, so the default is written once, on
    its field."""
    return SimpleNamespace(**{f.name: f.default if f.default is not MISSING else f.default_factory()
                              for f in fields(config) if f.default is not MISSING or f.default_factory is not MISSING})


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
    """A bad flag is one line (what is wrong), not a usage block longer than the screen. The
    settings of `--config FILE` (or BATON_CONFIG) become the defaults, so a flag still wins.
    `not_taken`: flags a sibling command takes and this one does not, each with the reason, said
    instead of "unrecognized arguments" (in a --config file too)."""

    not_taken: dict[str, str] = {}

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")

    def parse_known_args(self, args=None, namespace=None):
        args = list(sys.argv[1:] if args is None else args)
        config = self._option_string_actions.get("--config")
        path = _config_path(args) or (config.default if config is not None else None)
        if path:
            self.set_defaults(**config_defaults(self, path))
        ns, rest = super().parse_known_args(args, namespace)
        for arg in rest:
            name = arg.split("=", 1)[0]
            if name in self.not_taken:
                self.error(f"{name}: {self.not_taken[name]}")
        _take_positional_model(self, ns)
        return ns, rest


def parser(prog: str, description: str, usage: str | None = None) -> argparse.ArgumentParser:
    p = Parser(prog=prog, description=description, formatter_class=HelpFormatter, usage=usage or f"{prog} [flags]")
    p.add_argument("--help-all", action=_HelpAll)     # listed in --help once a hidden flag exists
    return p


def add_config_arg(p: argparse.ArgumentParser) -> None:
    flag(p, "--config", help="YAML file of settings by flag name (max-num-seqs: 8, prefix-caching: false, "
                             "served-model-name: [a, b]); a flag given too wins over the file, the file over "
                             "BATON_* variables")


# -- --config FILE.yaml ---------------------------------------------------------------------------
def _config_path(argv: list[str]) -> str | None:
    for i, arg in enumerate(argv):
        if arg == "--":
            break
        if arg == "--config" and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith("--config="):
            return arg.split("=", 1)[1]
    return None


def config_defaults(p: argparse.ArgumentParser, path: str) -> dict:
    """The file's settings as parser defaults {dest: value}, each checked as its flag would be; a
    setting the command does not take, or a value that does not parse, stops with the reason."""
    import yaml  # here: only a command given a file pays for it
    try:
        data = yaml.safe_load(Path(path).expanduser().read_text())
    except OSError as exc:
        p.error(f"--config {path}: {exc.strerror or exc}")
    except yaml.YAMLError as exc:
        p.error(f"--config {path}: not valid YAML: {' '.join(str(exc).split())}")
    if data is None:
        return {}
    if not isinstance(data, dict):
        p.error(f"--config {path}: the file must map flag names to values (max-num-seqs: 8), not hold a "
                f"{type(data).__name__}")
    return dict(_config_value(p, path, str(key), value) for key, value in data.items())


def _config_value(p: argparse.ArgumentParser, path: str, key: str, value) -> tuple[str, object]:
    option = "--" + key.lstrip("-").replace("_", "-")
    action = p._option_string_actions.get(option)
    if option in getattr(p, "not_taken", {}):
        p.error(f"--config {path}: {key}: {p.not_taken[option]}")
    if action is None or option in ("--config", "--help", "--help-all"):
        p.error(f"--config {path}: {key!r} is no setting of {p.prog}; the file takes its flags' long names")
    where = f"--config {path}: {key}"
    if isinstance(action, argparse.BooleanOptionalAction):
        on = _parse_bool(where, str(value)) if not isinstance(value, bool) else value
        return action.dest, (not on) if option.startswith("--no-") else on
    if action.nargs in ("+", "*"):
        items = value if isinstance(value, list) else str(value).replace(",", " ").split()
        return action.dest, [_parse(where, str(v), action.type or str, action.choices) for v in items]
    if isinstance(value, (dict, list)) or (action.type is int and isinstance(value, float)):
        p.error(f"{where}: {value!r} is not a {getattr(action.type, '__name__', 'str')}")
    return action.dest, _parse(where, str(value), action.type or str, action.choices)


def _take_positional_model(p: argparse.ArgumentParser, ns: argparse.Namespace) -> None:
    """`baton serve MODEL` as vLLM's `vllm serve MODEL`: the positional is --model."""
    tag = getattr(ns, "model_tag", None)
    if not tag:
        return
    default = p._option_string_actions["--model"].default
    if ns.model not in (default, tag):
        p.error(f"the model is given twice, {tag!r} and --model {ns.model!r}: give one")
    ns.model = tag


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
             "docker-compose and Kubernetes use); `--config FILE.yaml` (or `BATON_CONFIG`) sets any of them",
             "by its long name and wins over the variables; a flag, when given, wins over both:",
             "flag > file > `BATON_*` > default. `baton <command> --help` shows the same, but for the",
             "flags marked TEST ONLY, which only `--help-all` lists. Every server also takes the model",
             "as its first argument (`baton serve Qwen/Qwen3-0.6B`, as `vllm serve`).", "",
             "```yaml", "# baton.yaml: baton serve --config baton.yaml", "model: Qwen/Qwen3-0.6B",
             "max-num-seqs: 64", "prefix-caching: true", "served-model-name: [qwen3, default]", "```", "",
             "| flag | environment | what it does (default) | commands |", "| --- | --- | --- | --- |"]
    for flags, env, text, cmds in option_rows(commands):
        lines.append(f"| `{flags}` | {f'`{env}`' if env else ''} | {text.replace('|', '/')} | {cmds} |")
    lines += ["", "Variables without a flag: " + "; ".join(f"`{v.name}` ({v.help})" for v in environment.WITHOUT_FLAG)
              + ".", ""]
    return "\n".join(lines)


def port_clash(ports: list[tuple[int, str]]) -> str | None:
    """Two listeners of one process (or stack) given the same port, as (port, which flag): said
    before anything binds, instead of the second one's "address in use" (0: a free port, no clash)."""
    seen: dict[int, str] = {}
    for port, what in ports:
        if port and port in seen:
            return f"{seen[port]} and {what} are both port {port}: give them different ports"
        seen.setdefault(port, what)
    return None
