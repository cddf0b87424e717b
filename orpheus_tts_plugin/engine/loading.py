"""What an engine runs on, made from its config: the tokenizer, the decoder (warmed) and the backend (started).

Runs on the engine loop at start-up; a load failure names what is missing and how to get it (ModelLoadError).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..config import EngineConfig
from ..errors import EngineError, ModelLoadError
from ..spec import ModelSpec

if TYPE_CHECKING:
    from ..backends.protocol import TokenBackend
    from ..codec.decoder import FrameDecoder

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Loaded:
    """An engine's parts, ready to serve."""

    tokenizer: Any
    decoder: FrameDecoder
    backend: TokenBackend


async def load(
    cfg: EngineConfig, spec: ModelSpec, *, backend: TokenBackend | None = None, decoder: FrameDecoder | None = None
) -> Loaded:
    """Make and start what `cfg` names (`backend` and `decoder` replace those); a failure other than an EngineError
    arrives as a ModelLoadError."""
    try:
        return await _load(cfg, spec, backend, decoder)
    except Exception as exc:
        if isinstance(exc, EngineError):
            raise
        raise ModelLoadError(f"the engine failed to load: {type(exc).__name__}: {exc}") from exc


async def _load(
    cfg: EngineConfig, spec: ModelSpec, backend: TokenBackend | None, decoder: FrameDecoder | None
) -> Loaded:
    from ..backends import make_backend, make_tokenizer
    from ..codec.decoder import make_decoder
    from ..weights import SNAC, TOKENIZER, load_error, require_weights
    from .device import resolve_device

    device = resolve_device(cfg.device)
    source = cfg.tokenizer or cfg.model
    try:
        await asyncio.to_thread(require_weights, "the tokenizer", source, TOKENIZER)
        tokenizer = await asyncio.to_thread(make_tokenizer, cfg)
    except (OSError, ValueError) as exc:
        raise load_error("the tokenizer", source, exc) from exc
    try:
        if decoder is None and cfg.decoder == "snac":
            await asyncio.to_thread(require_weights, "SNAC", cfg.snac, SNAC)
        decoder = decoder or await asyncio.to_thread(make_decoder, cfg, device)
    except (OSError, ValueError) as exc:
        raise load_error("SNAC", cfg.snac, exc) from exc
    if cfg.compile and hasattr(decoder, "warm"):  # compile (and capture) every bucket now, not on the hot path
        await asyncio.to_thread(decoder.warm, _progress("compiling decoder buckets"))
    backend = backend or make_backend(cfg, spec, device)
    try:
        await backend.start()
    except (OSError, ValueError) as exc:
        raise load_error(f"the {cfg.backend} model", cfg.model, exc) from exc
    return Loaded(tokenizer, decoder, backend)


def _progress(what: str) -> Callable[[int, int], None]:
    """A progress callback (done, total): a tqdm bar on stderr if tqdm is installed, else log lines."""
    try:
        from tqdm import tqdm
    except ImportError:
        return lambda done, total: log.info("%s: %d/%d", what, done, total)
    bar: list[Any] = []

    def update(done: int, total: int) -> None:
        if not bar:
            bar.append(tqdm(total=total, desc=what, unit="bucket"))
        bar[0].update(done - bar[0].n)
        if done == total:
            bar[0].close()

    return update
