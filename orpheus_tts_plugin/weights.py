"""Fetching the Orpheus and SNAC weights that an engine config names into the Hugging Face cache."""

from __future__ import annotations

import argparse
import logging
import os

from .config import EngineConfig

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
