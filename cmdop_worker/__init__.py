"""cmdop-worker: run an LLM operator across a fleet of machines.

A coordinator advances each run one turn at a time; machine workers run the tools
addressed to them; Redis holds run state, carries events and the cancel key.
"""

__version__ = "0.1.0"
