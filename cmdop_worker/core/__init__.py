"""The pure core of the loop: it decides, the other wings do.

Tool catalogue and routing (`catalog`, `routing`, `tools`), history sanitation
(`history`), request building (`request`, `context`, `tokens`), the next step of a turn
(`step`, `intent`, `output`), retry delays (`retry`), request intake (`intake`),
child runs' shares of their parent's limits (`children`) and the provider's rate
limits and model fallback (`ratelimit`); what each event says (`event_data`); text
made safe for a terminal (`textsafe`: the surfaces print and the worker logs through
it).

No I/O: no celery, redis or anthropic, no environment, no clock; time and ids come in
as arguments. May import only `models`, `errors` and the standard library (and
pydantic; jsonschema, to check an output schema at intake). Called by the
coordinator, the model seam, the machine side and the client.
"""
