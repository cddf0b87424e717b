"""The process-wide engine: `OrpheusEngine` (`core`) admits streams, runs generation on a backend, and hands frames
to the decoder thread (`decode_worker`); what it runs on is made from its config (`loading`, `device`).

May import: root, runtime, speech, codec, backends.
"""
