"""Fetching the Orpheus and SNAC weights that an engine config names into the Hugging Face cache."""

from __future__ import annotations

import argparse
import logging
import os

from .config import EngineConfig
from .errors import ModelLoadError

logger = logging.getLogger(__name__)

HUB_FILES = ["*.json", "*.safetensors", "*.bin", "*.model", "*.txt", "*.tiktoken"]


def hub_repos(config: EngineConfig) -> list[str]:
    """Hub repos that an engine of `config` loads: LLM weights, tokenizer, SNAC (local dirs and URLs left out)."""
    repos = []
    if config.backend not in ("synthetic", "remote"):
        repos.append(config.model)
    if config.backend != "synthetic" or config.tokenizer:
        repos.append(config.tokenizer or config.model)
    if config.decoder == "snac":
        repos.append(config.snac)
    return [r for r in dict.fromkeys(repos) if r and not os.path.isdir(r) and not r.startswith(("http://", "https://"))]


def _looks_like_path(source: str) -> bool:
    return source.startswith(("/", "./", "../", "~")) or os.sep in source.strip("/").replace("/", "", 1)


def load_error(what: str, source: str | None, exc: BaseException) -> ModelLoadError:
    """One line saying why `what` (from `source`) could not be loaded, and how to get it."""
    first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
    if source and _looks_like_path(source) and not os.path.exists(os.path.expanduser(source)):
        return ModelLoadError(f"cannot load {what}: no such directory {source!r}")
    offline = "offline" in first.lower() or "connect" in first.lower() or "cache" in first.lower()
    if source and not os.path.isdir(source) and offline:
        return ModelLoadError(
            f"cannot load {what} {source!r}: it is not a local directory, not in the Hugging Face cache, and the "
            "hub cannot be reached. Fetch it where there is network with `orpheus-tts download` (or "
            "`python agent.py download-files`), or pass a local directory (`orpheus-tts make-test-model DIR` "
            "writes random-weight test checkpoints)"
        )
    return ModelLoadError(f"cannot load {what} {source!r}: {type(exc).__name__}: {first}")


def require_weights(what: str, source: str | None) -> None:
    """ModelLoadError at once if `source` is a hub id neither cached nor reachable (not after minutes of retries)."""
    if not source or os.path.isdir(source) or source.startswith(("http://", "https://")) or _looks_like_path(source):
        return
    from huggingface_hub import constants, try_to_load_from_cache

    if any(isinstance(try_to_load_from_cache(source, f), str) for f in ("config.json", "tokenizer_config.json")):
        return
    if not constants.HF_HUB_OFFLINE and _hub_reachable(constants.ENDPOINT):
        return
    raise load_error(what, source, OSError("offline: not in the cache and the hub cannot be reached"))


def _hub_reachable(endpoint: str, timeout_s: float = 3.0) -> bool:
    import socket
    from urllib.parse import urlparse

    url = urlparse(endpoint)
    try:
        socket.create_connection((url.hostname, url.port or 443), timeout=timeout_s).close()
    except OSError:
        return False
    return True


def download_files(*configs: EngineConfig) -> None:
    """Fetch the weights of `configs` (default: the default config) into the Hugging Face cache."""
    from huggingface_hub import snapshot_download

    for config in configs or (EngineConfig(),):
        for repo in hub_repos(config):
            logger.info("downloading %s", repo)
            snapshot_download(repo, allow_patterns=HUB_FILES)


def download_main(args: argparse.Namespace) -> int:
    """Run `orpheus-tts download` from parsed arguments."""
    config = EngineConfig(model=args.model, snac=args.snac)
    download_files(config)
    print(f"fetched {', '.join(hub_repos(config))} into the Hugging Face cache")
    return 0
