"""The Orpheus and SNAC weights that an engine config names: checked before anything loads, and fetched into
the Hugging Face cache."""

from __future__ import annotations

import argparse
import json
import logging
import os
from dataclasses import dataclass

from .config import COMPLETIONS_BACKENDS, EngineConfig
from .errors import ModelLoadError

logger = logging.getLogger(__name__)

HUB_FILES = ["*.json", "*.safetensors", "*.bin", "*.model", "*.txt", "*.tiktoken"]


@dataclass(frozen=True)
class Checkpoint:
    """A kind of checkpoint folder, known by its files: any one of `files`, and `config_key` in its config.json."""

    name: str
    files: tuple[str, ...]
    config_key: str | None = None

    @property
    def a_name(self) -> str:
        """The name with its article: "a tokenizer", "an Orpheus (Llama) checkpoint"."""
        return f"{'an' if self.name[0] in 'AEIOU' else 'a'} {self.name}"

    def held_by(self, folder: str) -> bool:
        """Whether `folder` holds a checkpoint of this kind."""
        if not any(os.path.exists(os.path.join(folder, f)) for f in self.files):
            return False
        return self.config_key is None or self.config_key in _config(folder)


LLM = Checkpoint("Orpheus (Llama) checkpoint", ("config.json",), "model_type")
SNAC = Checkpoint("SNAC checkpoint", ("config.json",), "vq_strides")
TOKENIZER = Checkpoint("tokenizer", ("tokenizer.json", "tokenizer_config.json", "tokenizer.model"))
KINDS = (LLM, SNAC, TOKENIZER)  # in the order a folder is described: a Llama folder holds a tokenizer too


def _config(folder: str) -> dict[str, object]:
    try:
        with open(os.path.join(folder, "config.json"), encoding="utf-8") as f:
            found = json.load(f)
    except (OSError, ValueError):
        return {}
    return found if isinstance(found, dict) else {}


def weight_sources(config: EngineConfig) -> list[tuple[str, str, Checkpoint | None]]:
    """(what, where from, kind of folder) of each thing an engine of `config` loads: tokenizer, SNAC, LLM weights."""
    sources: list[tuple[str, str, Checkpoint | None]] = []
    if config.tokenizer or config.model:
        sources.append(("the tokenizer", config.tokenizer or config.model, TOKENIZER))
    if config.decoder == "snac":
        sources.append(("SNAC", config.snac, SNAC))
    if config.backend not in ("synthetic", *COMPLETIONS_BACKENDS) and config.model:
        sources.append((f"the {config.backend} model", config.model, None))
    return sources


def hub_repos(config: EngineConfig) -> list[str]:
    """Hub repos that an engine of `config` loads: tokenizer, SNAC, LLM weights (local dirs and URLs left out)."""
    repos = dict.fromkeys(source for _, source, _ in weight_sources(config))
    return [r for r in repos if r and not os.path.isdir(r) and not r.startswith(("http://", "https://"))]


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
            "a LiveKit agent's `download-files`), or pass a local directory (`orpheus-tts make-test-model DIR` "
            "writes random-weight test checkpoints)"
        )
    return ModelLoadError(f"cannot load {what} {source!r}: {type(exc).__name__}: {first}")


def require_weights(what: str, source: str | None, kind: Checkpoint | None = None) -> None:
    """ModelLoadError at once, in one line with the fix, if `source` is a folder that is missing or holds no `kind`,
    or a hub id neither cached nor reachable (not after minutes of retries)."""
    if not source or source.startswith(("http://", "https://")):
        return
    folder = os.path.expanduser(source)
    if os.path.isdir(folder):
        if kind is not None and not kind.held_by(folder):
            raise ModelLoadError(f"cannot load {what} {source!r}: {_wrong_folder(folder, kind)}")
        return
    if _looks_like_path(source):
        if os.path.exists(folder):
            raise ModelLoadError(f"cannot load {what} {source!r}: it is a file; pass the folder that holds it")
        raise load_error(what, source, FileNotFoundError(source))
    from huggingface_hub import constants, try_to_load_from_cache

    if any(isinstance(try_to_load_from_cache(source, f), str) for f in ("config.json", "tokenizer_config.json")):
        return
    if not constants.HF_HUB_OFFLINE and _hub_reachable(constants.ENDPOINT):
        return
    raise load_error(what, source, OSError("offline: not in the cache and the hub cannot be reached"))


def _wrong_folder(folder: str, kind: Checkpoint) -> str:
    """Why `folder` is not a `kind` checkpoint, and which folder to pass instead where one is near (inside it or
    beside it, as `make-test-model` writes DIR/orpheus and DIR/snac)."""
    parent = os.path.dirname(os.path.abspath(folder))
    for where, near in (("inside it", folder), ("beside it", parent)):
        found = _first_holding(near, kind)
        if found is not None:
            return f"it holds no {kind.name}, but {found!r} {where} does: pass that folder"
    other = next((k for k in KINDS if k is not kind and k.held_by(folder)), None)
    holds = f"it holds {other.a_name}, not {kind.a_name}" if other else f"no {' or '.join(kind.files)} in it"
    return f"{holds}; pass the folder with {kind.a_name}"


def _first_holding(near: str, kind: Checkpoint) -> str | None:
    """The first folder directly in `near` (by name) that holds `kind`, if any."""
    try:
        entries = sorted(os.scandir(near), key=lambda e: e.name)
    except OSError:
        return None
    return next((e.path for e in entries if e.is_dir() and kind.held_by(e.path)), None)


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
    """Fetch the weights of `configs` (default: the default config) into the Hugging Face cache; ModelLoadError in
    one line with the remedy when the hub cannot be reached or a repo is gated."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import GatedRepoError, LocalEntryNotFoundError

    for config in configs or (EngineConfig(),):
        for repo in hub_repos(config):
            logger.info("downloading %s", repo)
            try:
                snapshot_download(repo, allow_patterns=HUB_FILES)
            except LocalEntryNotFoundError:  # offline, or no route to the hub: not fetched, not in the cache
                raise ModelLoadError(
                    f"cannot fetch {repo!r}: the Hugging Face hub cannot be reached (or HF_HUB_OFFLINE is set). "
                    "Run this where there is network, or test without weights: `orpheus-tts make-test-model DIR "
                    "--snac tiny` writes random-weight checkpoints to DIR/orpheus and DIR/snac"
                ) from None
            except GatedRepoError:
                raise ModelLoadError(
                    f"cannot fetch {repo!r}: it is gated; accept its licence on huggingface.co and set HF_TOKEN"
                ) from None


def download_main(args: argparse.Namespace) -> int:
    """Run `orpheus-tts download` from parsed arguments."""
    config = EngineConfig(model=args.model, snac=args.snac)
    download_files(config)
    print(f"fetched {', '.join(hub_repos(config))} into the Hugging Face cache")
    return 0
