"""What the package says about itself is true: one version (`baton --version` is the installed
metadata's), an Apache-2.0 LICENSE shipped in the wheel's metadata, dependency floors the code
needs, and the `npu` extra pinning torch_npu to the torch minor it is built for."""
from __future__ import annotations

import importlib.metadata
import re
import subprocess
import sys
import tomllib

from cluster import REPO
from packaging.requirements import Requirement

import baton

PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())


def _requirements(extra: str | None = None) -> dict[str, Requirement]:
    project = PYPROJECT["project"]
    reqs = project["dependencies"] if extra is None else project["optional-dependencies"][extra]
    return {Requirement(r).name.lower(): Requirement(r) for r in reqs}


def test_the_version_has_one_source():
    assert PYPROJECT["project"]["dynamic"] == ["version"]
    assert PYPROJECT["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "baton.__version__"}
    out = subprocess.run([sys.executable, "-m", "baton", "--version"], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == f"baton {baton.__version__}"
    assert importlib.metadata.version("baton") == baton.__version__, \
        "the installed metadata is older than baton/__init__.py: reinstall (make setup)"


def test_the_license_is_apache_2_and_ships_with_the_package():
    text = (REPO / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text
    assert PYPROJECT["project"]["license"] == "Apache-2.0" and PYPROJECT["project"]["license-files"] == ["LICENSE"]
    meta = importlib.metadata.metadata("baton")
    assert meta["License-Expression"] == "Apache-2.0"


def test_floors_are_what_the_code_needs():
    deps = _requirements()
    # Qwen3-VL (Qwen3VLForConditionalGeneration) arrived in transformers 4.57.0
    assert deps["transformers"].specifier.contains("4.57.0") and not deps["transformers"].specifier.contains("4.56.2")
    assert {"huggingface-hub", "pyyaml"} <= set(deps)      # Hub names; --config FILE.yaml
    # audio clips: soundfile's wheels from 0.12.1 bundle a libsndfile that decodes MP3; soxr resamples
    assert not deps["soundfile"].specifier.contains("0.12.0") and "soxr" in deps
    for req in deps.values():                              # every runtime dependency has a floor and a cap
        ops = {s.operator for s in req.specifier}
        assert ">=" in ops and "<" in ops, req


def test_the_npu_extra_pins_torch_npu_to_the_torch_minor_it_is_built_for():
    npu = _requirements("npu")
    torch_npu, torch = npu["torch-npu"].specifier, npu["torch"].specifier
    floor = next(s.version for s in torch_npu if s.operator == ">=")
    minor = ".".join(floor.split(".")[:2])                 # 2.10.0.post4 -> 2.10
    next_minor = f"{minor.split('.')[0]}.{int(minor.split('.')[1]) + 1}"
    for spec in (torch, torch_npu):
        assert spec.contains(f"{minor}.0") or spec.contains(floor)
        assert not spec.contains(f"{next_minor}.0") and not spec.contains(f"{minor.split('.')[0]}.9.0")


def test_the_readme_says_how_to_avoid_the_cuda_wheels_on_a_cpu_machine():
    readme = (REPO / "README.md").read_text()
    assert re.search(r"pip install torch==[\d.]+ --index-url https://download.pytorch.org/whl/cpu", readme)
