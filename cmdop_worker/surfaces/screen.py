"""Text from the fleet made safe to show on a person's terminal: `terminal_safe`
(in `cmdop_worker.core.textsafe`, where the worker's logs use it too) and `safe_markup`.

What `run`, `events`, `chat`, `machines`, `threads` and `approve` print comes from the
model, a tool, a machine or Redis, and any of it may be hostile: `textsafe` says which
characters a terminal would act on and how each is shown instead. `--json` output
never passes here: it stays byte-exact, and JSON escapes C0 itself.
"""

from __future__ import annotations

from cmdop_worker.core.textsafe import shown_as, terminal_safe

__all__ = ["safe_markup", "shown_as", "terminal_safe"]


def safe_markup(value: object) -> str:
    """A value from the fleet made fit for a rich markup template: safe for the
    terminal, with its square brackets escaped so rich shows them as text."""
    from rich.markup import escape

    return escape(terminal_safe(str(value)))
