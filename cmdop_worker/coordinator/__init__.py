"""The coordinator: advances runs one turn at a time and keeps every turn ending.

`runs` starts a run; `turn` executes one turn (lease, catalogue, history, request,
model call, next step); `calls` owns a tool call's life on the coordinator: it routes
the turn's calls, sends them to machine queues, and collects their results;
`local_tools` runs the tools the coordinator answers itself (`list_machines`,
`ask_machine(s)` and their child runs); `finish` ends a run;
`lease` keeps one executor per turn; `watchdog`, `recovery` and `liveness` answer
turns whose deadline passed, whose executor died, or whose machine went away;
`approvals` ends the wait of parked calls nobody answered, or whose run was cancelled.

May import: `core`, `state`, `llm`, `runtime`, `outcomes`, `celery_app` and the shared
top modules. Never the machine side or the surfaces. Called by `tasks` and
`lifecycle`.
"""
