"""The streaming SNAC decoder against SNAC's own whole-utterance decode, on the real 24 kHz architecture."""

from __future__ import annotations

import numpy as np
import pytest

from orpheus_tts_plugin.codec.decoder import NullDecoder, StreamingDecoder
from orpheus_tts_plugin.codec.snac import FADE_SAMPLES, SNAC24_LATENCY, offline_decode
from orpheus_tts_plugin.spec import SAMPLES_PER_FRAME
from orpheus_tts_plugin.tools.bench.reference import reference_decode


def random_frames(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 4096, size=(n, 7))


def _stream(decoder: StreamingDecoder, frames: np.ndarray) -> list[np.ndarray]:
    """Feed one frame per tick, decode whenever the state is ready, then flush: the chunks."""
    state, chunks = decoder.new_state(), []
    for frame in frames:
        state.pending.append(frame[None])
        if state.ready(decoder.first_chunk_frames):
            chunks.extend(decoder.decode([state]))
    state.final = True
    chunks.extend(decoder.decode([state]))
    return chunks


@pytest.mark.parametrize("n_frames", [1, 3, 4, 9])
def test_streamed_audio_equals_the_offline_decode(full_snac, n_frames: int) -> None:
    frames = random_frames(n_frames, n_frames)
    streamed = np.concatenate(_stream(StreamingDecoder(full_snac), frames))
    offline = offline_decode(full_snac, frames)
    assert streamed.size == offline.size == n_frames * SAMPLES_PER_FRAME
    assert np.abs(streamed.astype(int) - offline.astype(int)).max() <= 33
    assert np.abs(offline).max() > 1000  # real audio, not silence


def test_first_chunk_after_four_frames_holds_every_sample_the_receptive_field_allows(full_snac) -> None:
    decoder = StreamingDecoder(full_snac)
    assert decoder.latency_samples == SNAC24_LATENCY == NullDecoder().latency_samples
    chunks = _stream(decoder, random_frames(8, 2))
    first = 4 * SAMPLES_PER_FRAME - decoder.latency_samples
    assert first >= 3400
    sizes = [c.size for c in chunks]
    assert sizes[0] == first
    assert sizes[1:-1] == [SAMPLES_PER_FRAME] * 4  # one chunk per later frame
    assert sum(sizes) == 8 * SAMPLES_PER_FRAME


def test_no_audio_before_four_frames(full_snac) -> None:
    decoder = StreamingDecoder(full_snac)
    state = decoder.new_state()
    state.pending.append(random_frames(3, 3))
    assert not state.ready(decoder.first_chunk_frames)
    state.pending.append(random_frames(1, 4))
    assert state.ready(decoder.first_chunk_frames)


def test_every_frame_is_decoded_once(full_snac) -> None:
    decoder = StreamingDecoder(full_snac)
    _stream(decoder, random_frames(12, 5))
    assert decoder.stats()["decoded_frames"] == 12 + decoder.flush_frames  # not 4 windows a frame


def test_streams_at_the_same_point_share_one_call(full_snac) -> None:
    decoder = StreamingDecoder(full_snac)
    states = [decoder.new_state() for _ in range(6)]
    alone = StreamingDecoder(full_snac)
    solo = alone.new_state()
    frames = random_frames(6, 6)
    for k in range(6):
        for st in states:
            st.pending.append(frames[k : k + 1])
        solo.pending.append(frames[k : k + 1])
        if states[0].ready(4):
            calls = decoder.calls
            batch = decoder.decode(states)
            assert decoder.calls == calls + 1  # one call for all six rows
            ref = alone.decode([solo])[0]
            for audio in batch:
                assert np.abs(audio.astype(int) - ref.astype(int)).max() <= 1


def test_edges_fade_in_and_out_without_a_click(full_snac) -> None:
    audio = np.concatenate(_stream(StreamingDecoder(full_snac), random_frames(6, 7))).astype(int)
    ramp = np.arange(FADE_SAMPLES) / FADE_SAMPLES * 32767 + 1
    assert audio[0] == 0 and audio[-1] == 0
    assert (np.abs(audio[:FADE_SAMPLES]) <= ramp).all()
    assert (np.abs(audio[::-1][:FADE_SAMPLES]) <= ramp).all()


def test_reference_scheme_keeps_one_frame_of_a_four_frame_window(full_snac) -> None:
    windows = np.stack([random_frames(4, 8), random_frames(4, 9)])
    out = reference_decode(full_snac, windows)
    assert out.shape == (2, SAMPLES_PER_FRAME)


def test_null_decoder_follows_the_same_schedule() -> None:
    decoder = NullDecoder()
    sizes = [c.size for c in _stream(decoder, random_frames(7, 10))]
    assert sizes[0] == 4 * SAMPLES_PER_FRAME - SNAC24_LATENCY
    assert sum(sizes) == 7 * SAMPLES_PER_FRAME


def test_an_utterance_that_ended_before_its_first_decode_still_starts_with_a_short_chunk(full_snac) -> None:
    decoder = StreamingDecoder(full_snac)
    frames = random_frames(9, 11)
    state = decoder.new_state()
    state.pending.append(frames)
    state.final = True
    first = decoder.decode([state])[0]
    assert first.size == 4 * SAMPLES_PER_FRAME - decoder.latency_samples and not state.done
    rest = []
    while not state.done:  # the backlog follows at most 4 frames a call, in order
        rest.append(decoder.decode([state])[0])
        assert rest[-1].size <= 4 * SAMPLES_PER_FRAME
    assert len(rest) == 2  # frames 4-7, then frame 8 with the flush
    streamed = np.concatenate([first, *rest])
    assert np.abs(streamed.astype(int) - offline_decode(full_snac, frames).astype(int)).max() <= 33


# ---------------------------------------------------------------- pooled state, buckets, compilation


def steady_chunks(decoder: StreamingDecoder, frames: np.ndarray) -> list[list[np.ndarray]]:
    """Stream (B, n, 7) frames one frame a tick through `decoder` in one batch, then flush: chunks per row."""
    states = [decoder.new_state() for _ in frames]
    out: list[list[np.ndarray]] = [[] for _ in frames]
    for k in range(frames.shape[1] + 1):
        for st, f in zip(states, frames):
            if k < frames.shape[1]:
                st.pending.append(f[k : k + 1])
            else:
                st.final = True
        while any(st.ready(decoder.first_chunk_frames) and not st.done for st in states):
            for row, audio in zip(out, decoder.decode(states)):
                row.append(audio)
            if k < frames.shape[1]:
                break
    return out


def test_bucket_padding_never_leaks_into_another_streams_audio(tiny_snac) -> None:
    frames = np.stack([random_frames(9, 20 + i) for i in range(3)])  # 3 rows: every call padded to 4
    together = steady_chunks(StreamingDecoder(tiny_snac, max_streams=8), frames)
    for i in range(3):
        alone = steady_chunks(StreamingDecoder(tiny_snac, max_streams=8), frames[i : i + 1])[0]
        assert np.abs(np.concatenate(together[i]).astype(int) - np.concatenate(alone).astype(int)).max() <= 1
        assert np.abs(np.concatenate(alone).astype(int) - offline_decode(tiny_snac, frames[i]).astype(int)).max() <= 33


def test_a_slot_freed_mid_utterance_starts_clean_for_the_next_one(tiny_snac) -> None:
    decoder = StreamingDecoder(tiny_snac, max_streams=1)
    dropped = decoder.new_state()
    dropped.pending.append(random_frames(6, 30))
    decoder.decode([dropped])  # takes the only slot and leaves state in it
    decoder.release(dropped)  # a cancelled utterance
    frames = random_frames(5, 31)
    reused = np.concatenate(steady_chunks(decoder, frames[None])[0])
    assert np.abs(reused.astype(int) - offline_decode(tiny_snac, frames).astype(int)).max() <= 33
    assert decoder.stats()["decoder_free_slots"] == 1


def test_aten_ops_per_steady_tick_do_not_grow_with_the_streams(tiny_snac) -> None:
    from orpheus_tts_plugin.tools.bench.host import measure

    one, many = measure(tiny_snac, 1, False, 1), measure(tiny_snac, 16, False, 1)
    assert many["aten_ops_per_tick"] <= 1.2 * one["aten_ops_per_tick"]


def test_cuda_graphs_without_compile_is_refused_in_one_line() -> None:
    """The eager step copies host indices to the device, which a CUDA graph capture refuses (seen on an H200)."""
    with pytest.raises(ValueError, match="cuda_graphs needs compile=True"):
        StreamingDecoder(None, cuda_graphs=True)
