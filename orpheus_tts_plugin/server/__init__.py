"""`orpheus-tts serve`: one engine behind WebSocket and OpenAI-style HTTP, and the same app as a Ray Serve deployment.

Modules: `service` (what both transports share), `mux` (the server side of one WebSocket), `speech`
(`POST /v1/audio/speech`), `http_stream` (a stream as one HTTP post, for replicas behind Ray's proxy), `voices`
(`/v1/voices`) over `voice_store` and `shared_voices` (cloned voices shared by a deployment), `policy` (keys and
limits), `encoders`, `metrics` (`/metrics`), `app` (the FastAPI app), `serve` (uvicorn, SIGTERM drain), `ray`,
`ray_router`, `ray_voices` (Ray Serve). The client half is `..client`; both speak `..wire` and import nothing of
each other. Importing this package imports none of FastAPI, uvicorn or websockets.

May import: root, runtime, speech, engine, wire.
"""
