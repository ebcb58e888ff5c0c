"""What a model call cost in US dollars, from `genai-prices`' price table.

Called by the coordinator: the turn task prices every reply (`priced`) before adding
it to the run's usage, and a run that sets `budget_usd` is refused at its start when
its model has no price (`has_price`), since its budget could not be kept.

The table is the one bundled in the pinned `genai-prices` release: its auto-update
(`genai_prices.UpdatePrices`, a background HTTP fetch) is never started here, so
pricing makes no network call; prices change when the pin does. A model the table
does not know costs `None` (unknown), never 0. Cache writes are priced at the
5-minute write rate: `Usage` does not carry a 1-hour split.
"""

from __future__ import annotations

from datetime import UTC, datetime
from decimal import Decimal
from functools import lru_cache

import genai_prices

from cmdop_worker.models import Usage

PROVIDER = "anthropic"


def call_price_usd(usage: Usage, model: str, *, at_ms: int) -> Decimal | None:
    """The price of one call with `usage` (token counts as the Messages API reports
    them) made at `at_ms`, or None when the table knows no price for `model`."""
    if not has_price(model):
        return None
    # genai-prices counts input tokens in total, cache reads and writes included; the
    # API's `input_tokens` are the uncached ones only.
    tokens = genai_prices.Usage(
        input_tokens=usage.input_tokens
        + usage.cache_read_input_tokens
        + usage.cache_creation_input_tokens,
        cache_read_tokens=usage.cache_read_input_tokens,
        cache_write_tokens=usage.cache_creation_input_tokens,
        output_tokens=usage.output_tokens,
    )
    when = datetime.fromtimestamp(at_ms / 1000, tz=UTC)
    price = genai_prices.calc_price(
        tokens, model, provider_id=PROVIDER, genai_request_timestamp=when
    )
    return price.total_price


def priced(usage: Usage, model: str, *, at_ms: int) -> Usage:
    """`usage` of one call with its `cost_usd` (None for a model without a price)."""
    price = call_price_usd(usage, model, at_ms=at_ms)
    return usage.model_copy(update={"cost_usd": None if price is None else float(price)})


@lru_cache(maxsize=256)
def has_price(model: str) -> bool:
    """Whether the price table knows `model` (an id or an alias it lists)."""
    try:
        genai_prices.calc_price(genai_prices.Usage(), model, provider_id=PROVIDER)
    except LookupError:
        return False
    return True
