"""The machine side: runs the tool calls addressed to this machine, under its policy.

`worker` carries a call through (start, permission gate, run, record); `permissions`
decides allow / ask / deny; `toolbox` and `registry` hold the typed tools, `builtin`
the built-in ones; `process` runs a command as a killable process group; `audit`
writes the decision log.

May import: `core`, `state`, `runtime`, `outcomes` and the shared top modules. Never
the coordinator or the model seam. Called by the `cmdop.tool` task and `lifecycle`.
"""
