"""scripts/install_test_deps.sh (run by scripts/test.sh, the README's test command): installs chromium and
chromedriver for the chat-page test only when missing; apt-get, id and sudo are stubs here."""
from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "scripts" / "install_test_deps.sh"


def stub(folder: Path, name: str, body: str) -> None:
    path = folder / name
    path.write_text(f"#!/bin/bash\n{body}\n")
    path.chmod(0o755)


def run(tmp_path: Path, uid: int, have_browser: bool) -> tuple[subprocess.CompletedProcess, str]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    log = tmp_path / "apt.log"
    stub(bin_dir, "apt-get", f'echo "$@" >> {log}')
    stub(bin_dir, "id", f"echo {uid}")
    if have_browser:
        stub(bin_dir, "chromium", "true")
        stub(bin_dir, "chromedriver", "true")
    proc = subprocess.run(["/bin/bash", str(SCRIPT)], capture_output=True, text=True, env={"PATH": str(bin_dir)})
    return proc, log.read_text() if log.exists() else ""


def test_missing_browser_is_installed_as_root(tmp_path):
    proc, apt = run(tmp_path, uid=0, have_browser=False)
    assert proc.returncode == 0, proc.stderr
    assert apt.splitlines() == ["update -qq", "install -y -qq chromium chromium-driver"]


def test_present_browser_installs_nothing(tmp_path):
    proc, apt = run(tmp_path, uid=0, have_browser=True)
    assert proc.returncode == 0 and apt == ""


def test_without_root_it_says_what_to_install(tmp_path):
    proc, apt = run(tmp_path, uid=1000, have_browser=False)
    assert proc.returncode == 0 and apt == ""
    assert "chromium chromium-driver" in proc.stderr


@pytest.mark.parametrize("script", ["scripts/test.sh"])
def test_the_readme_test_command_runs_it(script):
    text = (REPO / script).read_text()
    assert 'bash "$here/scripts/install_test_deps.sh"' in text
    assert text.index("install_test_deps.sh") < text.index("pytest")
