"""Every setting's default is written once, and the environment is read in one module.

A setting is a flag of a Baton command (its dest and shipped default, from the parsers
themselves) or a field of a config record (a dataclass named *Config, *Options, *Params or
*Limits). Its default may be written as a literal in one place: the field, the flag's
`default=`, a DEFAULT_<NAME> constant, a fallback `mapping.get("name", literal)` or
`self.name = literal` in an `__init__`. A second literal equal to it under the same name, or
under a name the code links to it (`grace_seconds=args.grace`), fails: that place must name the
first (a constant, or the field's default through serving/options.defaults).

Not looked at: a function's own parameter defaults and a call's keyword arguments (its API and
its argument, not the setting's definition), and the unset/off values None, False and "", where
every optional setting and every switch starts.

The environment: `os.environ` / `getenv` appear only in baton/environment.py (benchmarks read
their own variables through benchmarks/environment.py, which uses it), bar a statement
`os.environ.setdefault("LIB_VAR", value)` that sets another library's knob.
"""
from __future__ import annotations

import ast
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SETTINGS_DIRS = ("baton", "serving", "router", "prefill_service", "decode_service", "kvtransfer", "models", "engine")
# each kernel's launch config (tile sizes, warps, stages) is tuned for that kernel alone: equal
# numbers there are no shared setting
KERNEL_TUNING = "engine/platforms/triton_kernels/"
ENV_DIRS = (*SETTINGS_DIRS, "benchmarks", "protos", "deploy")
CONFIG_SUFFIXES = ("Config", "Options", "Params", "Limits")
ENVIRONMENT_MODULES = {"baton/environment.py"}
ENV_NAMES = {"environ", "environb", "getenv", "getenvb", "putenv", "unsetenv"}


def sources(dirs: tuple[str, ...]) -> Iterator[tuple[str, str]]:
    for d in dirs:
        for path in sorted((REPO / d).rglob("*.py")):
            if "_pb2" not in path.name:
                yield str(path.relative_to(REPO)), path.read_text()


# -- where a default is written -------------------------------------------------------------------
def counted(value) -> bool:
    return isinstance(value, (bool, int, float, str)) and value is not False and value != ""


def same_value(value) -> tuple:
    """1 and 1.0 are one number; True is no number."""
    if isinstance(value, bool):
        return ("bool", value)
    return ("number", float(value)) if isinstance(value, (int, float)) else ("str", value)


def literal(node: ast.AST | None):
    return node.value if isinstance(node, ast.Constant) else None


def dest(option: str) -> str:
    return option.lstrip("-").replace("-", "_")


def _is_config_record(node: ast.ClassDef) -> bool:
    def name(d):
        d = d.func if isinstance(d, ast.Call) else d
        return d.attr if isinstance(d, ast.Attribute) else getattr(d, "id", "")
    return node.name.endswith(CONFIG_SUFFIXES) and any(name(d) == "dataclass" for d in node.decorator_list)


def _flag_default(call: ast.Call):
    """`flag(p, "--name", default=X)`, `p.add_argument("--name", default=X)`,
    `BackendFlag("--name", dict(default=X))`: ("name", X)."""
    option = next((a.value for a in call.args if isinstance(literal(a), str) and a.value.startswith("--")), None)
    if option is None:
        return None
    kws = list(call.keywords) + [k for a in call.args if isinstance(a, ast.Call) for k in a.keywords]
    default = next((k.value for k in kws if k.arg == "default"), None)
    return (dest(option), literal(default)) if default is not None else None


def written_defaults(source: str) -> Iterator[tuple[str, str, object, int]]:
    """(kind, name, literal, line) for each place in `source` that writes a default; kind "field"
    is a config record's field (a setting of its own)."""
    tree = ast.parse(source)
    for node in tree.body:                                  # DEFAULT_NAME = literal
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant):
            for t in node.targets:
                if isinstance(t, ast.Name) and t.id.startswith("DEFAULT_"):
                    yield "constant", t.id.removeprefix("DEFAULT_").lower(), node.value.value, node.lineno
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and _is_config_record(node):
            for item in node.body:
                if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name) and \
                        isinstance(item.value, ast.Constant):
                    yield "field", item.target.id, item.value.value, item.lineno
        elif isinstance(node, ast.FunctionDef) and node.name == "__init__":
            for sub in node.body:                           # self.name = literal, its starting value
                if isinstance(sub, ast.Assign) and isinstance(sub.value, ast.Constant):
                    for t in sub.targets:
                        if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self":
                            yield "attribute", t.attr, sub.value.value, sub.lineno
        elif isinstance(node, ast.Call):
            found = _flag_default(node)
            if found is not None:
                yield ("flag", *found, node.lineno)
            elif isinstance(node.func, ast.Attribute) and node.func.attr == "get" and len(node.args) == 2 and \
                    isinstance(literal(node.args[0]), str) and isinstance(node.args[1], ast.Constant):
                yield "fallback", node.args[0].value, node.args[1].value, node.lineno   # mapping.get("name", x)


def linked_names(source: str) -> Iterator[tuple[str, str]]:
    """(field, dest) for each `field=args.dest` with two names: one setting under both."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.keyword) and node.arg and isinstance(node.value, ast.Attribute) and \
                isinstance(node.value.value, ast.Name) and node.value.value.id == "args" and node.arg != node.value.attr:
            yield node.arg, node.value.attr


class Names:
    """Which names are one setting (union-find over the links)."""

    def __init__(self, links):
        self.parent: dict[str, str] = {}
        for a, b in links:
            self.parent[self.find(a)] = self.find(b)

    def find(self, name: str) -> str:
        while self.parent.get(name, name) != name:
            name = self.parent[name]
        return name


def second_literals(files: list[tuple[str, str]], flags: list[tuple[str, object]]) -> list[str]:
    """Each default of a setting (a flag's, or a config record field's) written as a literal in more
    than one place: "name = value written in file:line, file:line"."""
    names = Names(link for _, text in files for link in linked_names(text))
    written = [(where, line, kind, names.find(name), value) for where, text in files
               for kind, name, value, line in written_defaults(text) if counted(value)]
    settings = {(names.find(name), same_value(value)) for name, value in flags if counted(value)}
    settings |= {(name, same_value(value)) for _, _, kind, name, value in written if kind == "field"}
    places = defaultdict(list)
    for where, line, _, name, value in written:
        if (name, same_value(value)) in settings:
            places[name, same_value(value)].append((f"{where}:{line}", value))
    return [f"{name} = {at[0][1]!r} written in {', '.join(w for w, _ in at)}"
            for (name, _), at in places.items() if len(at) > 1]


def flag_settings() -> list[tuple[str, object]]:
    """(dest, shipped default) of every flag of every Baton command."""
    from baton import environment
    from baton.configuration import all_parsers
    with environment.shipped():
        parsers = all_parsers()
    return [(a.dest, a.default) for p in parsers.values() for a in p._actions if a.option_strings]


# -- who reads the environment --------------------------------------------------------------------
def _sets_a_library_knob(node: ast.AST) -> bool:
    """`os.environ.setdefault("NAME", value)` as a statement, NAME no BATON_* variable."""
    if not (isinstance(node, ast.Expr) and isinstance(node.value, ast.Call)):
        return False
    func, args = node.value.func, node.value.args
    return (isinstance(func, ast.Attribute) and func.attr == "setdefault" and isinstance(func.value, ast.Attribute)
            and func.value.attr == "environ" and bool(args) and isinstance(literal(args[0]), str)
            and not args[0].value.startswith("BATON_"))


def environment_reads(source: str) -> list[int]:
    """Lines of `source` that touch os.environ / getenv."""
    tree = ast.parse(source)
    allowed = {id(n.value.func.value) for n in ast.walk(tree) if _sets_a_library_knob(n)}
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in ENV_NAMES and id(node) not in allowed:
            lines.append(node.lineno)
        elif isinstance(node, ast.ImportFrom) and node.module == "os" and {a.name for a in node.names} & ENV_NAMES:
            lines.append(node.lineno)
    return sorted(lines)


# -- the tree ----------------------------------------------------------------------------------------
def test_every_default_is_written_once():
    files = [(where, text) for where, text in sources(SETTINGS_DIRS) if not where.startswith(KERNEL_TUNING)]
    found = second_literals(files, flag_settings())
    assert not found, "name the first place (a constant, or the field through serving/options.defaults):\n" + \
        "\n".join(found)


def test_only_the_environment_module_reads_the_environment():
    found = [f"{where}:{line}" for where, text in sources(ENV_DIRS) if where not in ENVIRONMENT_MODULES
             for line in environment_reads(text)]
    assert not found, "read it through baton/environment.py (get, for_children, set_default):\n" + "\n".join(found)


def test_the_environment_modules_are_named_where_a_reader_looks():
    from baton import environment
    from baton.serving import options
    assert "baton/environment.py" in options.__doc__ and "benchmarks/environment.py" in environment.__doc__


# -- the checks themselves: they flag what they should and nothing else ------------------------------
SETTINGS = [("max_tokens", 256), ("block_size", 16), ("max_waiting", 1024), ("grace", 30.0)]


def test_a_second_literal_for_a_setting_is_flagged_under_its_name_or_a_linked_one():
    files = [("a.py", "@dataclass\nclass WorkerConfig:\n    max_waiting: int = 1024\n    grace_seconds: float = 30.0\n"),
             ("b.py", 'flag(g, "--max-waiting", type=int, default=1024, help="")\n'
                      'flag(g, "--grace", type=float, default=30, help="")\n'
                      "def build(args):\n    return WorkerConfig(grace_seconds=args.grace)\n"),
             ("c.py", 'DEFAULT_MAX_TOKENS = 256\nlimit = d.get("block_size", 16)\n'),
             ("d.py", "@dataclass(slots=True)\nclass SamplingParams:\n    max_tokens: int = 256\n"),
             ("e.py", "class Tile:\n    def __init__(self):\n        self.block_size = 16\n"
                      "        if full:\n            self.max_waiting = 1024\n")]     # a later value: no default
    found = second_literals(files, SETTINGS)
    assert sorted(found) == ["block_size = 16 written in c.py:2, e.py:3",
                             "grace = 30.0 written in a.py:4, b.py:2",
                             "max_tokens = 256 written in c.py:1, d.py:3",
                             "max_waiting = 1024 written in a.py:3, b.py:1"]


def test_equal_literals_of_unrelated_names_and_places_are_not_flagged():
    source = '''
MAX_STOP_STRING_CHARS = 256            # equals max_tokens' default, under another name
@dataclass
class TileConfig:
    block: int = 16                    # equals block_size's default, under another name
@dataclass
class KVLayout:                        # a record, not a config: its fields are facts, not settings
    block_size: int = 16
def admit(max_waiting: int = 1024):    # a function's own parameter default: its API
    run(max_tokens=256)                # an argument, not a default
    return table.get("tile", 16), table.get("max_waiting")
flag(p, "--grace", type=float, default=GRACE_S, help="")   # names the one definition
flag(p, "--max-waiting", type=int, default=1024, help="")  # the one literal for max_waiting
'''
    assert second_literals([("x.py", source)], SETTINGS) == []


def test_the_tree_holds_unrelated_equal_literals_the_check_lets_be():
    """The guard is needed: 256, max_tokens' default, is also the longest stop string."""
    from baton.engine.requests.sampling_params import MAX_STOP_STRING_CHARS, SamplingParams
    assert MAX_STOP_STRING_CHARS == SamplingParams().max_tokens
    files = dict(sources(SETTINGS_DIRS))
    written = list(written_defaults(files["engine/requests/sampling_params.py"]))
    assert ("field", "max_tokens", 256) in [w[:3] for w in written]                    # the one definition
    assert "MAX_STOP_STRING_CHARS = 256" in files["engine/requests/sampling_params.py"]        # the other 256
    assert second_literals([("engine/requests/sampling_params.py", files["engine/requests/sampling_params.py"])], []) == []


@pytest.mark.parametrize("source, flagged", [
    ('import os\nos.environ.get("BATON_X")\n', [2]),
    ("import os\nx = os.getenv('HOME')\n", [2]),
    ("from os import environ\n", [1]),
    ('import os\nenv = dict(os.environ, A="1")\n', [2]),
    ('import os\nos.environ.setdefault("BATON_X", "1")\n', [2]),            # a Baton setting: read it here
    ('import os\nos.environ.setdefault("TOKENIZERS_PARALLELISM", "false")\n', []),     # a library's knob
    ("import os\nos.cpu_count(); os.path.join('a', 'environ')\n", []),
])
def test_environment_reads_are_found_and_nothing_else(source, flagged):
    assert environment_reads(source) == flagged
