"""The process-wide engine, `OrpheusEngine` (`core`), one role a module, in the order a stream meets them:

`core` (the caller's side: check, admit, read) → `admission` (a place, up to `max_streams`; pausing for a slow
reader) → `generation` (engine loop: tokens → frames) → `decode_worker` (decoder thread: frames → audio, to the
caller's loop). Beside them: `lifecycle` (start, health, failure, close), `voices` (cloned voices), `stats`
(counters); `loading` and `device` make what it runs on from its config.

May import: root, runtime, speech, codec, backends.
"""
