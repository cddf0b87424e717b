"""How OrpheusTTSService's health reaches Pipecat: the engine's readiness (`on_engine_ready`), overload as
usability (what a ServiceSwitcher's failover reads), each failure as one ErrorFrame of the right category, and
Pipecat's count of silent contexts kept to real silences. A mixin of the service (pipecat/tts.py), on its loop.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import re
from collections.abc import Callable
from typing import Any

from ..errors import EngineFailedError, EngineOverloadedError, Failure, failure_of, missing_extra

try:
    from pipecat.services.tts_service import TTSService
    from pipecat.utils.errors import ErrorCategory
except ImportError as exc:  # one line saying what to install, not a traceback from deep inside
    raise missing_extra("pipecat", "the Pipecat adapter", exc) from exc

logger = logging.getLogger("orpheus_tts_plugin.pipecat")

# How each kind of failure is reported: (what the ErrorFrame says, Pipecat category, permanent). Permanent =
# the service is written off (`is_usable` False; a ServiceSwitcher with ServiceSwitcherStrategyFailover moves
# to the next service). An overload is never permanent, but leaves the service unusable until the engine has
# room (`_overloaded`).
_REPORTS: dict[Failure, tuple[str, ErrorCategory, bool]] = {
    Failure.OVERLOADED: ("Orpheus engine overloaded", ErrorCategory.RATE_LIMIT, False),
    Failure.ENGINE_FAILED: ("Orpheus engine failed", ErrorCategory.SERVER, True),
    Failure.LOAD_FAILED: ("Orpheus engine failed to load", ErrorCategory.SERVER, True),
    Failure.CLOSED: ("Orpheus engine closed", ErrorCategory.SERVER, True),
    Failure.BAD_INPUT: ("cannot speak this text with these settings", ErrorCategory.APPLICATION, False),
    Failure.ENGINE_DOWN: ("Orpheus synthesis failed", ErrorCategory.SERVER, True),
    Failure.STREAM_FAILED: ("Orpheus synthesis failed", ErrorCategory.SERVER, False),
    Failure.TIMEOUT: ("Orpheus synthesis failed", ErrorCategory.SERVER, False),
    Failure.UNEXPECTED: ("Orpheus synthesis failed", ErrorCategory.SERVER, False),
}
_ENGINE_DOWN = ("failed", "closed")  # engine.health() statuses after which nothing more can be spoken
ENGINE_READY = "on_engine_ready"  # this service's own event
# The error TTSService._record_context_audio_outcome pushes for a context that completed with no audio.
_SILENT_CONTEXT = re.compile(r"TTS context (?P<context_id>\S+) completed with no audio")


class ServiceHealth(TTSService):
    """The health half of OrpheusTTSService (its attributes are declared in its `__init__`)."""

    # ---------------------------------------------------------------- events
    # Pipecat has no public way for a service to declare an event of its own (BaseObject._register_event_handler
    # and _call_event_handler, utils/base_object.py), so `on_engine_ready` keeps its handlers here.
    def add_event_handler(self, event_name: str, handler: Callable[..., Any]) -> None:
        """Pipecat's, plus `on_engine_ready`."""
        if event_name == ENGINE_READY:
            self._ready_handlers.append(handler)
        else:
            super().add_event_handler(event_name, handler)

    def remove_event_handler(self, event_name: str, handler: Callable[..., Any]) -> None:
        """Pipecat's, plus `on_engine_ready`."""
        if event_name == ENGINE_READY:
            self._ready_handlers = [h for h in self._ready_handlers if h is not handler]
        else:
            super().remove_event_handler(event_name, handler)

    async def _engine_ready(self) -> None:
        """Call each `on_engine_ready` handler (sync or async) with this service; one that raises is logged."""
        for handler in list(self._ready_handlers):
            try:
                result = handler(self)
                if inspect.isawaitable(result):
                    await result
            except Exception:  # a handler's bug must not stop the others, as in Pipecat's own events
                logger.exception("%s: on_engine_ready handler failed", self)

    async def _watch_engine_start(self) -> None:
        """Report the end of the engine's load: `on_engine_ready`, or at once a permanent error if it failed."""
        try:
            await self._engine.start()
            health = self._engine.health()
            if health["status"] == "failed":  # loaded once, failed since: start() itself succeeds
                raise EngineFailedError(f"engine failed: {health['reason']}")
        except Exception as exc:  # noqa: BLE001 - whatever the load raised, the service cannot speak
            await self._report_failure(exc)
            return
        await self._engine_ready()

    async def _watch_capacity(self) -> None:
        """Check the engine's room every `capacity_poll_s` while the service runs (a property read: no I/O)."""
        while True:
            await self._check_capacity()
            await asyncio.sleep(self._capacity_poll_s)

    async def _check_capacity(self) -> None:
        """Usable again once an overloaded engine has room; unusable as soon as a serving engine has none.

        `engine.load` is the share of `max_streams` in use, so a full engine is reported before it refuses an
        utterance, and a ServiceSwitcher moves the next one to the backup. A service speaking now is left
        alone: its next sentence takes the slot its current one frees. A request queued past
        `queue_timeout_s` behind a full batch does not show in the load: that overload is only seen when a
        request fails, and the service is usable again at the next check.
        """
        full = self._engine.load >= 1
        if self._overloaded and not full:
            self._overloaded = False
            await self.set_usable(True)  # Pipecat's on_usable_changed(service, True): the app may switch back
        elif full and not self._overloaded and self.is_usable and not self._replies and self._engine.ready:
            await self._report_failure(EngineOverloadedError("engine at capacity: no room for a new stream"))

    # ---------------------------------------------------------------- failures
    def _classify(self, exc: Exception) -> tuple[str, ErrorCategory, bool]:
        """What a failure means to Pipecat: the ErrorFrame's message, its category, and whether it is permanent."""
        return _REPORTS[failure_of(exc, serving=self._engine.health()["status"] not in _ENGINE_DOWN)]

    async def _report_failure(self, exc: Exception, context_id: str | None = None) -> None:
        """Push one ErrorFrame for `exc` (by `_REPORTS`); its context is not a silent one.

        A permanent failure writes the service off; an overload makes it unusable until the engine has room
        (`_check_capacity` brings it back). Either way `is_usable` is False before the frame travels, which is
        when a ServiceSwitcher's failover strategy reads it.
        """
        what, category, permanent = self._classify(exc)
        overloaded = self._unusable_while_overloaded and isinstance(exc, EngineOverloadedError)
        if overloaded:
            self._overloaded = True
        elif permanent:
            self._overloaded = False  # written off: room in the engine does not bring it back
        if context_id is not None:
            self._asked_contexts[context_id] = True
        await self.cancel_ttfb_metrics()
        await self.push_error(
            f"{self}: {what}: {exc}",
            exception=exc,
            category=category,
            force_treat_as_permanent=permanent or overloaded,
        )
        await self._restart_silence_count()

    # The base's write-off rule (`max_consecutive_zero_audio_contexts`, 3 by default: after that many completed
    # contexts in a row with no audio it pushes a permanent error and the service is no longer given work) is
    # for "a provider that accepts requests and stays silent", whose silence no error surfaces (TTSService.__init__,
    # _record_context_audio_outcome). A request whose failure was reported is no such silence: its own category
    # says whether it is permanent, and counting it would turn three transient overloads into a written-off
    # service. Nor is a context the base never gave to run_tts (it skips a service that is not usable, which may
    # be usable again when the context completes). Contexts the engine was asked to speak that stayed silent
    # without an error are still counted, so the rule keeps catching a wedged engine.
    # Pipecat has no public hook on that count (TTSService._record_context_audio_outcome, services/tts_service.py)
    # and its only public reset is set_usable(True); so the count restarts at each reported failure and after
    # such a context completes, and the per-context "no audio" error pushed for one is dropped (`push_error`).
    def _no_evidence(self, context_id: str) -> bool:
        """True if the context's silence says nothing about the engine: never asked to speak it, or it failed."""
        return self._asked_contexts.get(context_id, True)

    async def _restart_silence_count(self) -> None:
        """Restart the base's count of silent contexts (a no-op for `is_usable` and `on_usable_changed`)."""
        if self.is_usable:
            await self.set_usable(True)  # TTSService.set_usable zeroes the count; the flag is unchanged

    async def push_error(self, error_msg: str, *args: Any, **kwargs: Any) -> None:
        """Pipecat's, less the base's "completed with no audio" error for a context whose silence is no evidence."""
        silent = _SILENT_CONTEXT.fullmatch(error_msg)
        if silent and self._no_evidence(silent["context_id"]):
            return
        await super().push_error(error_msg, *args, **kwargs)
