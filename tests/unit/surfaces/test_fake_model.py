"""`cmdop-worker fake-model`: script files, what it prints, and how it stops.

The server runs as a real CLI process; its script files are checked the way a person
would get them wrong.
"""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from cmdop_worker.surfaces.fake_model import banner
from cmdop_worker.testing.fake_anthropic import load_scripts
from cmdop_worker.testing.fake_script import ScriptFileError

EXAMPLE = Path(__file__).resolve().parents[3] / "config" / "fake-model.example.toml"
CLI = [sys.executable, "-m", "cmdop_worker.surfaces.cli", "fake-model"]


def test_the_example_script_file_loads() -> None:
    scripts = load_scripts(EXAMPLE)
    assert sorted(scripts) == ["check", "disk", "reboot"]
    first = scripts["check"].turn(0).content
    assert [block.type for block in first] == ["text", "tool_use", "tool_use"]


def test_toml_and_json_files_say_the_same(tmp_path: Path) -> None:
    as_json = tmp_path / "scripts.json"
    as_json.write_text(
        json.dumps({"hi": {"turns": [{"content": [{"type": "text", "text": "x"}]}]}})
    )
    as_toml = tmp_path / "scripts.toml"
    as_toml.write_text('[[hi.turns]]\ncontent = [{ type = "text", text = "x" }]\n')
    assert load_scripts(as_json) == load_scripts(as_toml)


@pytest.mark.parametrize(
    ("name", "text", "problem"),
    [
        (
            "s.json",
            '{"a": [[{"type": "tool_use"}]]}',
            "script 'a': turns.0.content.0.tool_use.name",
        ),
        ("s.json", '{"a": [[{"type": "video"}]]}', "script 'a': turns.0.content.0: Input tag"),
        ("s.json", '{"a": {"turns": []}}', "script 'a': turns: List should have at least 1"),
        ("s.json", '{"a": {"turn": [["hi"]]}}', "script 'a': turns: Field required (and 1 more)"),
        ("s.json", '{"a b": [[{"type": "text", "text": "x"}]]}', "script name 'a b'"),
        ("s.json", "[1]", "expected a table of scripts by name, got list"),
        ("s.json", "{}", "it defines no scripts"),
        ("s.json", '{"a": ', "not valid JSON: Expecting value"),
        ("s.toml", "a = [\n", "not valid TOML"),
    ],
)
def test_a_bad_script_file_is_named_with_its_problem(
    tmp_path: Path, name: str, text: str, problem: str
) -> None:
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(ScriptFileError) as info:
        load_scripts(path)
    message = str(info.value)
    assert message.startswith(f"{path}: ")
    assert problem in message
    assert "\n" not in message


def test_a_missing_script_file_is_named(tmp_path: Path) -> None:
    with pytest.raises(ScriptFileError, match="cannot read it \\(No such file or directory\\)"):
        load_scripts(tmp_path / "nope.toml")


def test_the_banner_starts_with_the_line_to_export() -> None:
    lines = banner("http://127.0.0.1:8765", ["disk", "check"])
    assert lines[0] == "export ANTHROPIC_BASE_URL=http://127.0.0.1:8765"
    assert "check, disk" in lines[1] and "default, demo" in lines[1]
    assert '"[[script:check]] hello"' in lines[2]


def test_it_serves_the_file_until_ctrl_c_and_then_exits_cleanly() -> None:
    argv = [*CLI, "--script", str(EXAMPLE), "--port", "0"]
    with subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as proc:
        assert proc.stdout is not None
        first = proc.stdout.readline().strip()
        assert first.startswith("export ANTHROPIC_BASE_URL=http://127.0.0.1:")
        url = first.split("=", 1)[1]
        with urllib.request.urlopen(url + "/_fake/health", timeout=5) as response:
            assert {"check", "disk", "reboot"} <= set(json.loads(response.read())["scripts"])
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=10)
    assert proc.returncode == 0, err
    assert out.rstrip().endswith("fake model stopped")
    assert "Traceback" not in err


def test_a_bad_script_file_exits_2_with_one_line(tmp_path: Path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text('{"a": [[{"type": "tool_use"}]]}')
    done = subprocess.run([*CLI, "--script", str(bad)], capture_output=True, text=True, timeout=30)
    assert done.returncode == 2
    assert done.stdout == ""
    assert done.stderr.count("\n") == 1
    assert done.stderr.startswith(f"cmdop-worker fake-model: {bad}: script 'a': ")


def test_a_port_in_use_is_an_error_not_a_traceback() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = subprocess.run(
            [*CLI, "--port", str(port)], capture_output=True, text=True, timeout=30
        )
    assert done.returncode == 1
    assert done.stderr.startswith(f"cmdop-worker fake-model: cannot listen on 127.0.0.1:{port}")
    assert "Traceback" not in done.stderr
