"""The model seam: one Anthropic SDK call with retries and streaming, and its folding.

`client` makes the call (`AnthropicModel.complete`: its attempts with the core's
backoff, and fallback models); `attempt` makes one attempt (optional streaming, cancel
and deadline cut-offs); `wire` folds the SDK's raw stream
events and messages into the core's `ModelReply`; `traced` makes each call a
`chat <model>` trace span; `pricing` prices a call in dollars (genai-prices' bundled
table, no network); `limiter` waits for the fleet's rate limiter and teaches it every
response's rate-limit headers (an SDK middleware).

May import: `core`, `state` (the cancel watch), `runtime`, `config`, `errors`,
anthropic, genai-prices. Never the coordinator, the machine side or the surfaces. Called by the
coordinator's turn.
"""
