"""What people and other services touch: the client, the CLI, the live view, the demo.

`client` is the Python API (`Client`, `Run`; `aio` its asyncio twin), and the one
way every other surface reaches the fleet (`answer` and `approvals`: its answers to
parked calls); `cli` parses, calls the client and renders
(`render`, `follow`, `chat` with its approval commands in `chat_answers`), every
value from the fleet shown through `screen` (the operator's terminal is a trust
boundary too); `typed_events` gives the event JSON its types; `fleet` starts a
local Redis and workers as subprocesses (the demo, the tests, the benchmarks); `demo`
runs the scripted demo on them; `fake_model` serves the scripted model in the
foreground (`cmdop-worker fake-model`); `gateway` serves the HTTP API, its resumable SSE
and the run viewer page (`static/`) over the client (`gateway_runs`), with its door in
`gateway_guard` and the decisions behind it in `gateway_auth` (tokens, rate) and
`gateway_browser` (Host names, content type, what a web page can send) — the trust
boundary — what it reads parsed strictly by `gateway_input`, its shapes and OpenAPI
document in `gateway_schema`.

May import: `state`, `core`, `celery_app` and the shared top modules. Never the
coordinator, the machine side, the model seam or `runtime`: a surface reaches the
fleet through the client and the state layer only.
"""
