"""`orpheus-tts serve` and its client: one engine behind WebSocket and OpenAI-style HTTP, `RemoteEngine` to reach it.

Modules: `protocol` (the wire format), `service` (what both transports share), `mux` (the server side of
one WebSocket), `speech` (`POST /v1/audio/speech`), `metrics` (`/metrics`), `app` (the FastAPI app),
`serve` (uvicorn, SIGTERM drain), `connection` (the client side of one WebSocket), `upstream` (one server of a
RemoteEngine's list, and where a new stream goes), `client` (`RemoteEngine`).
Importing this package imports none of FastAPI, uvicorn or websockets.
"""
