"""Fakes that ship with the product: a scripted Anthropic HTTP server for demos and tests.

`python -m cmdop_worker.testing.fake_anthropic --port P [--script-file F]` serves the
Messages API (JSON and SSE) from a script (`fake_script`), with injectable faults and
the API's rate limits and headers (`fake_limits`).
Imports nothing else of the package.
"""
