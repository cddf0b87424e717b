"""`RemoteEngine`: an engine's interface over one or more `orpheus-tts serve` servers (or a Ray Serve proxy).

Modules: `connection` (the client side of one WebSocket), `stream_posts` (each stream as an HTTP post of its own,
for servers behind Ray's proxy), `upstream` (one server of a RemoteEngine's list, and where a new stream goes),
`remote_engine` (`RemoteEngine`, the callers' side) and its parts: `settings` (its arguments), `pool` (its servers,
kept connected), `router` (where each stream goes, failover), `server_terms` (what the servers accept: voices,
sampling, limits), `stats` (counters). The server half is `..server`; both speak `..wire` and import nothing of each
other. Importing this package imports no websockets or aiohttp.

May import: root, runtime, speech, wire.
"""
