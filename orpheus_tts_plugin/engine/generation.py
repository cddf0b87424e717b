"""Generation on the engine loop: each admitted stream's requests go to the backend, its tokens come back as
frames for the decoder thread, and a stream's end (done, failed, cancelled) releases it exactly once.
"""

from __future__ import annotations

import asyncio
import contextlib

from ..backends.protocol import BackendError, FinishReason, GenerationRequest, PausableStream
from ..codec.codes import FrameParser
from ..errors import EngineClosedError, EngineError
from ..runtime.loop_thread import post
from ..spec import SAMPLE_RATE, SAMPLES_PER_FRAME
from .decode_worker import CallerStream, Utterance


class Generation:
    """`OrpheusEngine`'s engine-loop side of every stream, and the decoder thread's callbacks (a mixin)."""

    def _init_generation(self) -> None:
        self._kick_pending = False  # engine loop only

    def _begin(
        self, stream: CallerStream, requests: list[tuple[GenerationRequest, str]], token_log: list[int] | None
    ) -> None:
        if stream.closed or stream not in self._open:  # cancelled, or failed with the engine, before it began
            self._release(stream)
            self._generation_over(stream)
            return
        stream.task = self._loop.create_task(self._generate(stream, requests, token_log))

    async def _generate(
        self, stream: CallerStream, requests: list[tuple[GenerationRequest, str]], token_log: list[int] | None
    ) -> None:
        worker = self._worker
        try:
            for i, (req, limit_kind) in enumerate(requests):
                utt = worker.open(stream, i, last=i == len(requests) - 1)
                await self._generate_utterance(utt, req, limit_kind, token_log)
                worker.end(utt)
        except asyncio.CancelledError:
            worker.drop(stream)
            if not stream.closed:  # not the caller's cancel: the engine is shutting down or failed
                post(stream, EngineClosedError("engine closed") if self._closed else EngineError("stream cancelled"))
            self._release(stream)
        except Exception as exc:  # noqa: BLE001 - delivered to the caller
            worker.drop(stream)
            failure = getattr(self._backend, "failure", None)
            if failure is not None:  # the backend's thread died: nothing will be served any more
                self._fail(f"the {self.config.backend} backend failed: {failure}")
            err = exc if isinstance(exc, EngineError) else EngineError(str(exc))
            if err is not exc:
                err.__cause__ = exc
            post(stream, err)
            self._release(stream)
        finally:
            self._generation_over(stream)

    def _generation_over(self, stream: CallerStream) -> None:
        """Engine loop: `stream` generates no more; a speculation learns the audio generated for it."""
        if stream.speculation is not None:
            stream.speculation.ended(stream.frames * SAMPLES_PER_FRAME / SAMPLE_RATE)

    async def _generate_utterance(
        self, utt: Utterance, req: GenerationRequest, limit_kind: str, token_log: list[int] | None
    ) -> None:
        """Feed one request's tokens as frames to the decoder; its first token must come within the queue timeout."""
        parser = FrameParser(self.spec)
        tokens = self._backend.generate(req)
        ids_iter = tokens.__aiter__()
        n_tokens = 0
        try:
            while True:
                try:
                    if n_tokens == 0:
                        ids = await asyncio.wait_for(ids_iter.__anext__(), self.config.queue_timeout_s)
                    else:
                        ids = await ids_iter.__anext__()
                except StopAsyncIteration:
                    break
                except asyncio.TimeoutError:
                    raise self._queue_timeout() from None
                n_tokens += len(ids)
                frames = parser.feed(ids)
                if len(frames):
                    self._worker.push(utt, frames)
                    self._kick_soon()
                if token_log is not None:
                    token_log.extend(ids)
                if utt.stream.unread_s() > self._pause_s and isinstance(tokens, PausableStream):
                    await self._wait_for_reader(utt.stream, tokens)
        finally:
            await tokens.aclose()
            utt.stream.frames += parser.frames_out
            utt.stream.usage.output_tokens += n_tokens + (tokens.finish_reason == FinishReason.STOP)  # its end id
            self._counters.count_utterance(parser, n_tokens, tokens.finish_reason, limit_kind)
        if token_log is not None:
            token_log.append(self.spec.end_of_speech)
        if tokens.finish_reason == FinishReason.ERROR:
            raise BackendError(f"backend failed request {req.request_id}")

    def _kick_soon(self) -> None:
        if not self._kick_pending:
            self._kick_pending = True
            self._loop.call_soon(self._kick)

    def _kick(self) -> None:
        self._kick_pending = False
        self._worker.kick()

    def _cancel(self, stream: CallerStream) -> None:
        if stream.task is not None and not stream.task.done():
            stream.task.cancel()  # its handler drops decoder state and releases the stream
        else:
            self._worker.drop(stream)
            self._release(stream)

    @staticmethod
    def _cancel_generations(streams: list[CallerStream]) -> None:
        """Engine loop: stop generating for streams that have already been ended."""
        for stream in streams:
            if stream.task is not None:
                stream.task.cancel()

    def _stream_done(self, stream: CallerStream) -> None:
        """Decoder thread: the final chunk of `stream` is on its way to the caller."""
        self._counters.count("streams_completed")
        self._release(stream)

    def _stream_failed(self, stream: CallerStream, error: EngineError) -> None:
        """Decoder thread: `stream` failed there (its error is on its way); stop generating for it."""
        self._counters.count("streams_failed_in_decoder")
        self._release(stream)
        with contextlib.suppress(RuntimeError):
            self._loop.call_soon_threadsafe(self._cancel, stream)
