"""`cmdop-worker acl`: the Redis ACL users of a fleet, as `ACL SETUSER` lines.

    cmdop-worker acl --machine web-1 --password-file web-1.pw   # a machine worker's user
    cmdop-worker acl --coordinator --password-file coord.pw     # coordinators, gateway, CLI

Prints one line for `redis-cli` (or an ACL file, without the leading `ACL SETUSER`);
the rules themselves are built in `state.acl`. The key prefix and the broker's key
prefix are the configured ones (`CMDOP_KEY_PREFIX`, `CMDOP_BROKER_KEY_PREFIX`). With
no password file, a password is generated and said on stderr with the URL to use.
"""

from __future__ import annotations

import argparse
import secrets
import sys
from pathlib import Path
from typing import Any

from cmdop_worker.config import Settings
from cmdop_worker.models import MACHINE_PATTERN
from cmdop_worker.state.acl import coordinator_rules, machine_rules, setuser_line
from cmdop_worker.state.keys import Keys

EXIT_OK, EXIT_USAGE = 0, 2


def add_acl_command(sub: Any) -> None:
    acl = sub.add_parser("acl", help="print the Redis ACL user of a machine or a coordinator")
    role = acl.add_mutually_exclusive_group(required=True)
    role.add_argument("--machine", help="the machine worker's name")
    role.add_argument("--coordinator", action="store_true", help="coordinators, gateway, CLI")
    acl.add_argument("--user", help="the ACL user's name (default: cmdop-machine-NAME, cmdop)")
    acl.add_argument("--password-file", type=Path, help="read the password from this file")


def cmd_acl(args: argparse.Namespace) -> int:
    import re

    if args.machine is not None and not re.match(MACHINE_PATTERN, args.machine):
        print(f"cmdop-worker: '{args.machine}' is not a valid machine name", file=sys.stderr)
        return EXIT_USAGE
    password = _password(args.password_file)
    if password is None:
        return EXIT_USAGE
    settings = Settings.from_env()
    if args.machine is not None:
        user = args.user or f"cmdop-machine-{args.machine}"
        rules = machine_rules(
            args.machine,
            password,
            keys=Keys(settings.key_prefix),
            broker_prefix=settings.broker_key_prefix,
        )
    else:
        user = args.user or "cmdop"
        rules = coordinator_rules(password)
    print(setuser_line(user, rules))
    if args.password_file is None:
        print(
            f"generated password; the worker's URL: redis://{user}:{password}@HOST:PORT/0",
            file=sys.stderr,
        )
    return EXIT_OK


def _password(path: Path | None) -> str | None:
    if path is None:
        return secrets.token_urlsafe(24)
    try:
        text = path.read_text().strip()
    except OSError as exc:
        print(f"cmdop-worker: cannot read --password-file: {exc}", file=sys.stderr)
        return None
    if not text or any(c.isspace() for c in text):
        print("cmdop-worker: --password-file: one password, with no spaces", file=sys.stderr)
        return None
    return text
