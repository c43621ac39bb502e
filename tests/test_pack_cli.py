"""CLI happy paths, and a real process printing a one-line error without a traceback."""

import os
import subprocess
import sys
from pathlib import Path

from click.testing import CliRunner

from llamapack.cli import main

REPO = Path(__file__).resolve().parent.parent


def test_pack_inspect_verify(moe_gguf, tmp_path):
    runner = CliRunner()
    out = tmp_path / "custom.expert-pack"
    result = runner.invoke(main, ["pack", str(moe_gguf), "-o", str(out), "--safety-margin-mib", "0"])
    assert result.exit_code == 0, result.output
    assert f"wrote {out}" in result.stdout and "3 layers x 8 experts" in result.stdout
    assert out.exists() and Path(str(out) + ".manifest.json").exists()

    result = runner.invoke(main, ["inspect", str(out)])
    assert result.exit_code == 0, result.output
    assert "MoE layers: 3 (1..3), experts per layer: 8" in result.stdout
    assert "down: Q6_K/F16/Q4_K" in result.stdout

    result = runner.invoke(main, ["verify", str(out) + ".manifest.json", "--against", str(moe_gguf), "-q"])
    assert result.exit_code == 0, result.output
    assert result.stdout.startswith("OK: 24 blocks") and "match" in result.stdout


def test_python_dash_m_prints_one_line_error(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-m", "llamapack", "verify", str(tmp_path / "none.expert-pack")],
                          capture_output=True, text=True, env=env, cwd=tmp_path)
    assert proc.returncode == 1
    assert proc.stderr.count("\n") == 1 and proc.stderr.startswith("Error: manifest not found")
    assert "Traceback" not in proc.stderr + proc.stdout
