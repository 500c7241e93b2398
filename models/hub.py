"""Models by Hugging Face Hub name (`Qwen/Qwen3-0.6B`), fetched and cached by huggingface_hub as
every HF tool does: its cache (HF_HOME / HF_HUB_CACHE), HF_TOKEN, HF_ENDPOINT (a mirror) and
offline mode (HF_HUB_OFFLINE=1) mean here what they mean to transformers and vLLM.

Only what Baton loads is fetched: configs, safetensors weights, tokenizer files.
"""
from __future__ import annotations

import re
from pathlib import Path

from baton import environment

HUB_NAME = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")        # ORG/NAME, as `from_pretrained` takes it
WANTED = ["*.json", "*.safetensors", "*.txt", "*.model", "*.jinja", "*.tiktoken"]   # merges.txt, tokenizer.model


def is_hub_name(name: str) -> bool:
    """ORG/NAME that is no local path (a local folder of that name wins, as in transformers)."""
    return bool(HUB_NAME.fullmatch(name)) and not Path(name).expanduser().exists()


def offline() -> bool:
    from huggingface_hub import constants
    return bool(constants.HF_HUB_OFFLINE)


def offline_problem(repo_id: str, revision: str | None) -> str | None:
    """With the network off (HF_HUB_OFFLINE=1): what is wrong when the model is not in the cache,
    told in a blink (no download would be tried)."""
    if not offline():
        return None
    from huggingface_hub import try_to_load_from_cache
    if isinstance(try_to_load_from_cache(repo_id, "config.json", revision=revision), str):
        return None
    at = f" at revision {revision}" if revision else ""
    return (f"--model {repo_id}{at}: not in the Hugging Face cache ({_cache_dir()}) and HF_HUB_OFFLINE is set; "
            f"fetch it once with the network on (baton serve {repo_id}, or hf download {repo_id}), or point "
            "HF_HOME / HF_HUB_CACHE at a cache that has it")


def download(repo_id: str, revision: str | None = None) -> Path:
    """The model's snapshot folder in the HF cache, fetched where missing (offline: the cached one)."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )
    at = f" at revision {revision}" if revision else ""
    try:
        folder = Path(snapshot_download(repo_id, revision=revision, allow_patterns=WANTED))
    except GatedRepoError:
        raise ValueError(f"--model {repo_id}: a gated model; accept its terms on its Hub page and set HF_TOKEN "
                         "to a token of that account") from None
    except RevisionNotFoundError:
        raise ValueError(f"--revision {revision}: no such branch, tag or commit of {repo_id}") from None
    except RepositoryNotFoundError:
        raise ValueError(f"--model {repo_id}: no such model on the Hub ({_endpoint()}); check the name, or set "
                         "HF_TOKEN if it is private") from None
    except LocalEntryNotFoundError:
        why = "HF_HUB_OFFLINE is set" if offline() else f"the Hub ({_endpoint()}) cannot be reached"
        raise ValueError(f"--model {repo_id}{at}: not in the Hugging Face cache ({_cache_dir()}) and {why}; fetch "
                         f"it where the Hub answers (hf download {repo_id}) into this cache, or set HF_ENDPOINT to "
                         "a mirror") from None
    except HfHubHTTPError as exc:
        raise ValueError(f"--model {repo_id}{at}: the Hub answered {' '.join(str(exc).split())[:300]}") from None
    _check_snapshot(repo_id, folder)
    return folder


def _check_snapshot(repo_id: str, folder: Path) -> None:
    if not (folder / "config.json").is_file():
        raise ValueError(f"--model {repo_id}: no config.json in it; Baton serves transformers checkpoints "
                         "(config.json + *.safetensors)")
    if not any(folder.glob("*.safetensors")):
        raise ValueError(f"--model {repo_id}: no .safetensors weights in it (Baton does not load pickled "
                         ".bin weights); convert them, or pick a repository that has safetensors")


def _cache_dir() -> str:
    from huggingface_hub import constants
    return constants.HF_HUB_CACHE


def _endpoint() -> str:
    from huggingface_hub import constants
    return environment.get("HF_ENDPOINT") or constants.ENDPOINT
