"""What people and other services touch: the client, the CLI, the live view, the demo.

`client` is the Python API (`Client`, `Run`; `aio` its asyncio twin), and the one
way every other surface reaches the fleet (`answer` and `approvals`: its answers to
parked calls); `cli` parses, calls the client and renders
(`render`, `follow`); `typed_events` gives the event JSON its types; `fleet` starts a
local Redis and workers as subprocesses (the demo, the tests, the benchmarks); `demo`
runs the scripted demo on them; `fake_model` serves the scripted model in the
foreground (`cmdop-worker fake-model`).

May import: `state`, `core`, `celery_app` and the shared top modules. Never the
coordinator, the machine side, the model seam or `runtime`: a surface reaches the
fleet through the client and the state layer only.
"""
