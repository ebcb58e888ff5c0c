"""One CLI: every command says an unknown id the same way, every option says what it
does, a prompt comes from an argument, a file or stdin, and the long-running commands
(`worker`, `gateway`) start with one line of ours.

The table runs each command that takes an id against ids the fleet never saw: each
must write its refusal to stderr (naming the id), nothing to stdout, and exit 2.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import time

import pytest

from cmdop_worker.models import MAX_PROMPT_CHARS
from cmdop_worker.surfaces.cli import build_parser
from tests.e2e.test_cli import CLI, cli, text
from tests.gateway_proc import GatewayProcess

pytestmark = pytest.mark.e2e

UNKNOWN_RUN = "never-a-run-7c1e"
UNKNOWN_THREAD = "never-a-thread-7c1e"


@pytest.fixture
def cli_env(fleet, fleet_env) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("FORCE_COLOR", "TTY_COMPATIBLE")}
    return {**env, **fleet_env, "NO_COLOR": "", "COLUMNS": "100"}


@pytest.mark.parametrize(
    ("args", "named"),
    [
        (["events", UNKNOWN_RUN], UNKNOWN_RUN),
        (["events", UNKNOWN_RUN, "--json"], UNKNOWN_RUN),
        (["cancel", UNKNOWN_RUN], UNKNOWN_RUN),
        (["cancel", UNKNOWN_RUN, "--ui"], UNKNOWN_RUN),
        (["approve", UNKNOWN_RUN, "toolu_never"], UNKNOWN_RUN),
        (["approve", UNKNOWN_RUN, "toolu_never", "--deny"], UNKNOWN_RUN),
        (["threads", "show", UNKNOWN_THREAD], UNKNOWN_THREAD),
        (["threads", "show", UNKNOWN_THREAD, "--json"], UNKNOWN_THREAD),
        (["threads", "delete", UNKNOWN_THREAD], UNKNOWN_THREAD),
    ],
    ids=lambda v: " ".join(v) if isinstance(v, list) else "",
)
def test_an_unknown_id_is_stderr_and_exit_2_from_every_command(cli_env, args, named) -> None:
    done = cli(cli_env, *args)
    assert (done.returncode, done.stdout) == (2, ""), done
    assert done.stderr.startswith("cmdop-worker: ") and named in done.stderr, done.stderr
    assert len(done.stderr.splitlines()) == 1, done.stderr


def test_an_unknown_call_of_a_known_run_is_exit_2(cli_env, client, script) -> None:
    run = client.submit(prompt=script([text("nothing to approve")]))
    run.wait(timeout=30)
    done = cli(cli_env, "approve", run.run_id, "toolu_never")
    assert (done.returncode, done.stdout) == (2, "") and "toolu_never" in done.stderr


def test_cancelling_an_ended_run_is_not_an_error(cli_env, client, script) -> None:
    run = client.submit(prompt=script([text("over already")]))
    run.wait(timeout=30)
    done = cli(cli_env, "cancel", run.run_id)
    assert done.returncode == 0, done
    assert done.stdout == f"run {run.run_id} has already ended (done); nothing to cancel\n"


def _options(parser: argparse.ArgumentParser, path: str) -> list[tuple[str, argparse.Action]]:
    found = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                found += _options(sub, f"{path} {name}")
        elif not isinstance(action, argparse._HelpAction):
            found.append((path, action))
    return found


def test_every_option_and_argument_has_help() -> None:
    options = _options(build_parser(), "cmdop-worker")
    assert len(options) > 40  # the walk reached the subcommands
    bare = [
        f"{path} {'/'.join(a.option_strings) or a.dest}"
        for path, a in options
        if not (a.help or "").strip() or a.help == argparse.SUPPRESS
    ]
    assert bare == []


def test_a_prompt_from_a_file_and_from_stdin(cli_env, script, tmp_path) -> None:
    from_file = tmp_path / "prompt.txt"
    from_file.write_text(script([text("read from the file")]))
    done = cli(cli_env, "run", "--prompt-file", str(from_file), "--json")
    assert done.returncode == 0, done.stderr
    assert '"read from the file"' in done.stdout.splitlines()[-1]

    prompt = script([text("read from stdin")])
    piped = subprocess.run(
        [CLI, "run", "-", "--json"], env=cli_env, input=prompt, capture_output=True, text=True
    )
    assert piped.returncode == 0, piped.stderr
    assert '"read from stdin"' in piped.stdout.splitlines()[-1]


@pytest.mark.parametrize("source", ["file", "stdin"])
def test_a_prompt_over_the_limit_is_refused_before_anything_starts(
    cli_env, tmp_path, source
) -> None:
    big = "x" * (MAX_PROMPT_CHARS + 1)
    if source == "file":
        path = tmp_path / "big.txt"
        path.write_text(big)
        done = cli(cli_env, "run", "--prompt-file", str(path))
        where = str(path)
    else:
        done = subprocess.run(
            [CLI, "run", "-"], env=cli_env, input=big, capture_output=True, text=True
        )
        where = "stdin"
    assert (done.returncode, done.stdout) == (2, ""), done.stderr
    assert done.stderr == (
        f"cmdop-worker: the prompt in {where} is over the limit of {MAX_PROMPT_CHARS} characters\n"
    )


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (["run"], "give the prompt as an argument, - for stdin, or --prompt-file PATH"),
        (["run", "hi", "--prompt-file", "p.txt"], "give the prompt as an argument"),
        (["run", "--prompt-file", "/nonexistent/p.txt"], "cannot read /nonexistent/p.txt"),
    ],
)
def test_a_prompt_given_twice_none_or_unreadable_is_exit_2(cli_env, args, said) -> None:
    done = cli(cli_env, *args)
    assert (done.returncode, done.stdout) == (2, "") and said in done.stderr, done.stderr


def test_worker_start_is_one_line_of_ours_without_celerys_banner(fleet_env, tmp_path) -> None:
    name = "banner-check"
    out = tmp_path / "worker.out"
    err = tmp_path / "worker.err"
    with out.open("wb") as stdout, err.open("wb") as stderr:
        worker = subprocess.Popen(
            [CLI, "worker", "--machine", name, "--concurrency", "2"],
            env={**os.environ, **fleet_env},
            stdout=stdout,
            stderr=stderr,
            start_new_session=True,
        )
    try:
        give_up = time.monotonic() + 60
        while "ready" not in err.read_text() and time.monotonic() < give_up:
            assert worker.poll() is None, err.read_text()
            time.sleep(0.1)
        assert "ready" in err.read_text(), err.read_text()
    finally:
        os.killpg(worker.pid, signal.SIGTERM)
        worker.wait(timeout=30)
    said = out.read_text()
    first = said.splitlines()[0]
    assert first.startswith("cmdop-worker ") and f"machine worker {name}@" in first, said
    assert f"queue cmdop.machine.{name}, 2 threads, Redis redis://" in first, said
    everything = said + err.read_text()
    for celery_noise in ("-E", "task events", "[queues]", "SecurityWarning", "-------------- "):
        assert celery_noise not in everything, everything


def test_gateway_start_says_the_viewers_url(fleet_env, tmp_path) -> None:
    log = tmp_path / "gateway.log"
    gw = GatewayProcess({**fleet_env, "CMDOP_GATEWAY_TOKENS": "t0ken"}, log=log).start()
    try:
        first = gw.logs().splitlines()[0]
    finally:
        gw.stop()
    assert first == f"cmdop-worker gateway: run viewer at {gw.url}/ (a token is required)"
