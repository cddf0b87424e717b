"""Replay saved token ids through the decoder, streaming (as the engine feeds it) or whole at once."""

from __future__ import annotations

import argparse

import numpy as np
from torch import nn

from ..codec.codes import FrameParser
from ..codec.decoder import StreamingDecoder
from ..codec.snac import offline_decode
from ..spec import ModelSpec


def split_utterances(ids: np.ndarray, spec: ModelSpec) -> list[np.ndarray]:
    """Saved ids (utterances each closed by the end-of-speech id) → one id array per utterance."""
    ids = np.asarray(ids, dtype=np.int64).reshape(-1)
    ends = np.flatnonzero(ids == spec.end_of_speech)
    pieces = np.split(ids, ends + 1)
    return [p[:-1] if p.size and p[-1] == spec.end_of_speech else p for p in pieces if p.size]


def replay_streaming(decoder: StreamingDecoder, ids: np.ndarray, spec: ModelSpec) -> np.ndarray:
    """Feed ids one by one to the frame parser and decode whenever the engine would: int16 audio."""
    out: list[np.ndarray] = []
    for utterance in split_utterances(ids, spec):
        parser, state = FrameParser(spec), decoder.new_state()
        for token in utterance:
            frames = parser.feed([token])
            if len(frames):
                state.pending.append(frames)
            if state.ready(decoder.first_chunk_frames):
                out.extend(decoder.decode([state]))
        state.final = True
        out.extend(decoder.decode([state]))
        while not state.done:  # a first chunk is capped at first_chunk_frames; the rest follows
            out.extend(decoder.decode([state]))
    return np.concatenate(out) if out else np.zeros(0, dtype=np.int16)


def replay_offline(snac: nn.Module, ids: np.ndarray, spec: ModelSpec) -> np.ndarray:
    """Parse each utterance whole and decode it in one SNAC call: int16 audio."""
    out = []
    for utterance in split_utterances(ids, spec):
        frames = FrameParser(spec).feed(utterance)
        out.append(offline_decode(snac, frames))
    return np.concatenate(out) if out else np.zeros(0, dtype=np.int16)


def decode_main(args: argparse.Namespace) -> int:
    """`orpheus-tts decode`: replay saved ids through the streaming decoder (or offline) to a WAV file."""
    from ..codec.snac import load_snac
    from ..engine.device import resolve_device
    from ..spec import SAMPLES_PER_FRAME, spec_for
    from .wav import write_wav

    spec = spec_for(args.model_family)
    ids = np.load(args.tokens)
    device = resolve_device(args.device if args.device != "auto" else "cpu")
    snac = load_snac(args.snac, device, noise_seed=args.noise_seed)
    if args.offline:
        audio = replay_offline(snac, ids, spec)
    else:
        audio = replay_streaming(StreamingDecoder(snac, args.first_chunk_frames), ids, spec)
    write_wav(args.out, audio)
    n_utt = len(split_utterances(ids, spec))
    mode = "offline" if args.offline else "streaming"
    print(
        f"wrote {args.out}: {audio.size} samples ({audio.size / SAMPLES_PER_FRAME:g} frames) from "
        f"{n_utt} utterance(s), {mode} decode"
    )
    return 0
