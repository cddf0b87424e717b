"""What `orpheus-tts serve` and `RemoteEngine` share, and nothing else: `protocol` (the wire format: messages, the
audio frame header, error names) and `routing` (the one rule that sends a new stream to a server or replica).
Standard library and the package's config, errors and types only.

May import: root.
"""
