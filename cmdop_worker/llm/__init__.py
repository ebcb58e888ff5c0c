"""The model seam: one Anthropic SDK call with retries and streaming, and its folding.

`client` makes the call (`AnthropicModel.complete`: retries with the core's backoff,
optional streaming, cancel and deadline cut-offs); `wire` folds the SDK's raw stream
events and messages into the core's `ModelReply`; `traced` makes each call a
`chat <model>` trace span.

May import: `core`, `state` (the cancel watch), `runtime`, `config`, `errors`,
anthropic. Never the coordinator, the machine side or the surfaces. Called by the
coordinator's turn.
"""
