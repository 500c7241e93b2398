"""The structure the folders promise, checked on what users install: the built wheel puts
one name, `baton`, in site-packages, and its imports keep the layering (import-linter's
contracts in pyproject.toml: imports point down, between the folders and between the engine's
layers, no cycles, the router clear of the workers' runtime (serving/worker/), torch-free plumbing
and request types). The router takes of the engine only its request types (engine/requests/),
which need nothing else of it."""
from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PRODUCT_DIRS = ("baton", "serving", "router", "prefill_service", "decode_service", "kvtransfer", "models",
                "engine", "benchmarks", "protos")
MAX_PRODUCT_FILE_LINES = 700


@pytest.fixture(scope="module")
def installed_tree(tmp_path_factory) -> Path:
    """The wheel, built from a clean copy of the tracked sources (baton/'s links as links, as the
    Dockerfiles' COPY gives them), unpacked as pip would install it."""
    src, out, tree = (tmp_path_factory.mktemp(n) for n in ("src", "wheel", "site"))
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=REPO, check=True,
                           capture_output=True, text=True).stdout.split()
    for name in files:
        if name.split("/")[0] in ("tests", "docs"):
            continue
        (src / name).parent.mkdir(parents=True, exist_ok=True)
        if (REPO / name).is_symlink():
            (src / name).symlink_to(os.readlink(REPO / name))
        elif (REPO / name).is_file():
            shutil.copy2(REPO / name, src / name)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(out),
                    str(src)], check=True, capture_output=True)
    (wheel,) = out.glob("baton-*.whl")
    zipfile.ZipFile(wheel).extractall(tree)
    return tree


def _packages(root: Path) -> set[Path]:
    return {p.parent.relative_to(root) for p in root.rglob("__init__.py")}


def test_the_wheel_ships_every_package_of_the_sources(installed_tree):
    """A new sub-package (engine/runner/, ...) is one line in pyproject.toml's package list."""
    shipped = _packages(installed_tree / "baton")
    for d in PRODUCT_DIRS:
        if d in ("baton", "protos"):
            continue
        missing = {d / p for p in _packages(REPO / d) if Path(d) / p not in shipped}
        assert not missing, f"add to [tool.setuptools] packages: {sorted(map(str, missing))}"


def test_the_checkout_imports_as_installed_without_an_install():
    """baton/ links each folder under the name the package gives it (baton/engine -> ../engine, ...), so
    `baton.engine.llm` resolves in the checkout for static tools (pyright, editors) and plain
    PYTHONPATH=. as it does installed."""
    mapped = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    for name, folder in mapped.items():
        if name == "baton":
            continue
        link = REPO / "baton" / name.removeprefix("baton.")
        assert link.is_symlink() and link.resolve() == (REPO / folder).resolve(), f"ln -s ../{folder} {link}"
    code = ("import sys; sys.meta_path[:] = [f for f in sys.meta_path if 'editable' not in str(getattr(f, '__module__', ''))]; "
            "import baton.engine.llm, baton.router.server, baton.v1.router_pb2; print(baton.engine.llm.__file__)")
    run = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=dict(os.environ, PYTHONPATH=str(REPO)),
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == str(REPO / "baton" / "engine" / "llm.py")


def test_the_wheel_installs_only_the_baton_namespace(installed_tree):
    top = sorted(p.name for p in installed_tree.iterdir() if not p.name.endswith(".dist-info"))
    assert top == ["baton"]
    for sub in ("v1", "router", "prefill_service", "decode_service", "kvtransfer", "models", "engine", "serving",
                "benchmarks"):
        assert (installed_tree / "baton" / sub / "__init__.py").exists(), sub
    entry = (next(installed_tree.glob("*.dist-info")) / "entry_points.txt").read_text()
    assert "baton = baton.cli:main" in entry


def test_the_wheel_ships_the_chat_templates_users_name(installed_tree, tmp_path):
    """`--chat-template hermes_tools` works from a non-editable install (the template is package data)."""
    code = "from baton.router.chat_templates import resolve; print(resolve('hermes_tools'))"
    run = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=dict(os.environ, PYTHONPATH=str(installed_tree)),
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    path = Path(run.stdout.strip())
    assert path.is_relative_to(installed_tree) and "<tool_call>" in path.read_text()


def test_imports_keep_the_layering_contracts(installed_tree, tmp_path):
    # run from an empty directory: lint-imports puts the working directory first on sys.path
    env = dict(os.environ, PYTHONPATH=str(installed_tree))
    lint = Path(sys.executable).with_name("lint-imports")
    run = subprocess.run([str(lint), "--config", str(REPO / "pyproject.toml"), "--no-cache", "--no-logo"],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "5 kept, 0 broken" in run.stdout


@pytest.mark.parametrize("where, code, broken", [
    ("engine", "from baton.router import server", "baton.engine.upward -> baton.router"),
    ("engine/scheduling", "from baton.engine.runner import sampler", "baton.engine.scheduling.upward -> baton.engine.runner"),
    ("engine/requests", "import torch", "baton.engine.requests.upward -> torch"),
    ("router", "from baton.serving.worker import worker_config",
     "baton.router.upward -> baton.serving.worker.worker_config"),
], ids=["engine-to-router", "scheduling-to-runner", "requests-to-torch", "router-to-worker-runtime"])
def test_an_upward_import_breaks_the_contract(installed_tree, tmp_path, where, code, broken):
    """The check is live: an engine module importing the router, the scheduler's layer importing the
    runner, a request type importing torch, the router importing the workers' runtime: each fails it."""
    tree = tmp_path / "site"
    shutil.copytree(installed_tree, tree)
    (tree / "baton" / where / "upward.py").write_text(code + "\n")
    lint = Path(sys.executable).with_name("lint-imports")
    run = subprocess.run([str(lint), "--config", str(REPO / "pyproject.toml"), "--no-cache", "--no-logo"],
                         cwd=tmp_path, env=dict(os.environ, PYTHONPATH=str(tree)), capture_output=True, text=True,
                         timeout=120)
    assert run.returncode != 0
    assert broken in run.stdout


def _engine_imports(path: Path) -> list[str]:
    """The `baton.engine...` modules a file names in its imports (at any depth: lazy ones too)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            found += [f"{node.module}.{a.name}" if node.module in ("baton", "baton.engine") else node.module
                      for a in node.names]
    return [m for m in found if m == "baton.engine" or m.startswith("baton.engine.")]


def test_the_router_and_the_request_types_import_of_the_engine_only_the_request_types():
    """engine/requests/ is the router's whole view of the engine (the same SamplingParams,
    tokenizer and structured output as the workers'), besides engine/config.py (torch-free: the
    defaults it shares with the workers' engines), and requests/ stands on nothing else of the
    engine: the router never loads the scheduler, the runner or torch."""
    allowed = {"router": ("baton.engine.requests.", "baton.engine.config."),
               "engine/requests": ("baton.engine.requests.",)}
    outside = [f"{path.relative_to(REPO)}: {module}"
               for folder, ok in allowed.items() for path in sorted((REPO / folder).rglob("*.py"))
               for module in _engine_imports(path) if not f"{module}.".startswith(ok)]
    assert not outside, outside


def test_no_product_file_is_over_700_lines():
    long = {}
    for d in PRODUCT_DIRS:
        for f in (REPO / d).rglob("*.py"):
            if "_pb2" in f.name:
                continue
            n = len(f.read_text().splitlines())
            if n > MAX_PRODUCT_FILE_LINES:
                long[str(f.relative_to(REPO))] = n
    assert not long, f"split these by idea: {long}"


MAX_PART_FILE_LINES = 400


def test_the_engines_parts_stay_small_and_use_no_other_objects_privates():
    """The engine and its model runner are split by concept (engine/: the engine composes its KV
    exchange, kv_exchange.py; engine/runner/: the runner composes the parts), each part with a narrow
    interface. Each is under MAX_PART_FILE_LINES, and reads `_names` only of `self`/`cls`: a helper
    that needs something of another object gets a public name for it."""
    long, reaching = {}, []
    for path in sorted([*(REPO / "engine").glob("*.py"), *(REPO / "engine" / "runner").glob("*.py")]):
        name = str(path.relative_to(REPO))
        text = path.read_text()
        if len(text.splitlines()) > MAX_PART_FILE_LINES:
            long[name] = len(text.splitlines())
        for node in ast.walk(ast.parse(text)):
            private = isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")
            if private and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
                reaching.append(f"{name}:{node.lineno} {ast.unparse(node)}")
    assert not long, f"split these by idea: {long}"
    assert not reaching, reaching


# argparse keeps its flags in `_option_string_actions` and offers no public way to them; our
# Parser subclass and its helpers read it (serving/options.py)
THIRD_PARTY_PRIVATES = {"_option_string_actions"}


def _private_names_of_our_classes(trees: dict[Path, ast.Module]) -> set[str]:
    """`_names` our classes give themselves: attributes set on self, and methods."""
    names = set()
    for tree in trees.values():
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self":
                names.add(node.attr)
            elif isinstance(node, ast.ClassDef):
                names.update(m.name for m in node.body if isinstance(m, ast.FunctionDef | ast.AsyncFunctionDef))
    return {n for n in names if n.startswith("_") and not n.startswith("__")}


def test_no_product_code_reads_another_objects_privates():
    """A `_name` of one of our classes is read only through `self` or `cls`: whatever needs it from
    outside gets a public name (the false-positive guard: privates of third-party modules, like
    torch._C or sys._getframe, are no class of ours and are not flagged)."""
    trees = {path: ast.parse(path.read_text()) for d in PRODUCT_DIRS for path in sorted((REPO / d).rglob("*.py"))
             if "_pb2" not in path.name}
    private = _private_names_of_our_classes(trees) - THIRD_PARTY_PRIVATES
    reaching = [f"{path.relative_to(REPO)}:{node.lineno}: {ast.unparse(node)}"
                for path, tree in trees.items() for node in ast.walk(tree)
                if isinstance(node, ast.Attribute) and node.attr in private
                and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))]
    assert not reaching, "give these a public name:\n" + "\n".join(reaching)
    assert "_getframe" not in private and "_C" not in private


def test_the_fast_subsets_slow_list_names_test_modules_that_exist():
    """make test-fast leaves out conftest.SLOW_MODULES: a renamed module must not slip into it."""
    from conftest import SLOW_MODULES
    modules = {p.stem for p in (REPO / "tests").rglob("test_*.py")}
    assert SLOW_MODULES <= modules, sorted(SLOW_MODULES - modules)
