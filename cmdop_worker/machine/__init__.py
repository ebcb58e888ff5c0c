"""The machine side: runs the tool calls addressed to this machine, under its policy.

`worker` carries a call through (start, canonical paths, permission gate, run,
record); `parked` parks a call the gate says to ask about; `side` holds the worker's
standing parts (policy, audit, sandbox). The trust
boundary: `paths` (the path a file tool will touch), `permissions` (allow / ask /
deny, on `shell`'s parse of a command), `floor` (what nothing may touch), `policy`
(the TOML file) and `sandbox` (bubblewrap: what a command may then do). `registry`
holds the typed tools (a call's `ToolContext` and `ToolReply` in `toolcall`),
`builtin` the built-in ones; `process` runs a command
as a killable process group; `filejail` runs the file tools in the call's sandbox,
through a pool of `fileserver` processes (`fileproc`) doing what `fileops` and
`filesearch` say; `tooljail` runs the operator's own `@tool` functions there too,
through `toolserve` processes from the same pool; `audit` writes the decision log.

May import: `core`, `state`, `runtime`, `outcomes` and the shared top modules. Never
the coordinator or the model seam. Called by the `cmdop.tool` task and `lifecycle`.
"""
