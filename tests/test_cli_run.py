"""``llamapack run`` / ``demo`` / ``synth``: through click's CliRunner and as real ``python -m llamapack`` processes."""
from __future__ import annotations

import llama_cpp  # noqa: F401 - before numpy where this file decides (see docs/hook.md: static C++ runtime)

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from llamapack.cli import main
from llamapack.pack import build_pack
from llamapack.run import expert_read_bytes
from llamapack.synth import write_model

REPO = Path(__file__).resolve().parent.parent
PROMPT = "Once upon a time"
GREEDY = ["-p", PROMPT, "-n", "12", "--temp", "0", "-t", "2", "-c", "256"]
STATS_LINES = ("prefill: ", "decode: ", "expert cache: ", "expert bytes read per token: ")


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Two tiny models that differ only by seed, each with its pack beside it."""
    folder = tmp_path_factory.mktemp("cli_run")
    paths = {}
    for seed in (0, 1):
        model = write_model(folder / f"m{seed}.gguf", "qwen3moe-tiny", seed=seed)
        paths[seed] = (model, Path(build_pack(model, progress=False, safety_margin_mib=0).pack_path))
    return paths


def python_m(*args: str, **env: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO), **env}
    return subprocess.run([sys.executable, "-m", "llamapack", *args], capture_output=True, text=True, env=env,
                          timeout=300)


def invoke(*args: str, **kw):
    result = CliRunner().invoke(main, list(args), **kw)
    return result.exit_code, result.stdout, result.stderr


def generated_text(stdout: str) -> str:
    assert stdout.endswith("\n")
    return stdout[:-1]


def check_stats_lines(stderr: str, cache: str) -> None:
    lines = stderr.splitlines()
    assert [line[:len(start)] for line, start in zip(lines, STATS_LINES)] == list(STATS_LINES), stderr
    assert lines[2].startswith(cache), lines[2]


def test_run_pack_gguf_direct_and_plain(models, tmp_path):
    model, pack = models[0]
    stats_path = tmp_path / "stats.json"
    code, out, err = invoke("run", str(model), *GREEDY, "--pack", "--stats-json", str(stats_path))
    assert code == 0, err
    text = generated_text(out)
    assert len(text) > 12
    check_stats_lines(err, "expert cache: hit rate ")
    assert "\ndecode: 11 tokens in " in err

    stats = json.loads(stats_path.read_text())
    assert (stats["n_requests"], stats["n_generated"], stats["n_decoded"]) == (1, 12, 11)
    assert stats["n_prompt"] == 4  # "Once upon a time": 4 gpt-2 tokens, no BOS
    assert stats["prefill_s"] > 0 and stats["decode_s"] > 0
    assert stats["decode_tok_s"] == pytest.approx(11 / stats["decode_s"])
    pack_stats = stats["pack"]
    assert pack_stats["source"] == str(pack) and pack_stats["gguf_direct"] is False
    assert pack_stats["acquires"] == 12 * 4  # one per MoE layer (4) per eval (prompt + 11 tokens)
    assert pack_stats["cache_hits"] + pack_stats["cache_misses"] > 0
    assert stats["hit_rate"] == pack_stats["hit_rate"] and 0 <= stats["hit_rate"] <= 1
    assert stats["read_bytes"] == expert_read_bytes(pack_stats) > 0  # a fresh pool: every read was in this run
    assert stats["read_bytes_per_token"] == pytest.approx(stats["read_bytes"] / 15)

    # the same pool contents, read from the GGUF instead of the pack: the same tokens; its own process
    proc = python_m("run", str(model), *GREEDY, "--gguf-direct")
    assert proc.returncode == 0, proc.stderr
    assert generated_text(proc.stdout) == text
    check_stats_lines(proc.stderr, "expert cache: hit rate ")

    for run in (invoke, python_m):  # plain llama.cpp: every expert resident, no cache
        result = run("run", str(model), *GREEDY)
        code, out, err = result if isinstance(result, tuple) else (result.returncode, result.stdout, result.stderr)
        assert code == 0, err
        assert len(generated_text(out)) > 12
        check_stats_lines(err, "expert cache: none")


def test_run_explicit_pack_path_and_cache_budget(models, tmp_path):
    model, pack = models[0]
    stats_path = tmp_path / "stats.json"

    def n_slots(*cache_args: str) -> int:
        code, out, err = invoke("run", str(model), *GREEDY, "-ub", "2", *cache_args, f"--pack={pack}",
                                "--stats-json", str(stats_path))
        assert code == 0, err
        return json.loads(stats_path.read_text())["pack"]["n_slots"]

    assert n_slots("--cache-slots", "8") == 8
    small, large = n_slots("--cache-vram-mib", "40"), n_slots("--cache-vram-mib", "80")
    assert 8 <= small < 16 * 4 and large in (2 * small, 2 * small + 1)  # MiB budget -> whole slots


def test_run_with_prefetch_and_ram_tier_writes_the_same_text(models, tmp_path):
    model, _ = models[0]
    stats_path = tmp_path / "stats.json"
    code, plain, err = invoke("run", str(model), *GREEDY, "-ub", "1", "--pack", "--cache-slots", "4")
    assert code == 0, err
    code, out, err = invoke("run", str(model), *GREEDY, "-ub", "1", "--pack", "--cache-slots", "4", "--prefetch",
                            "--ram-cache-mib", "64", "--stats-json", str(stats_path))
    assert code == 0, err
    assert out == plain  # greedy: the same tokens with the lookahead and the RAM tier on
    pack = json.loads(stats_path.read_text())["pack"]
    assert pack["prefetch_slots"] == 4 and pack["ram_slots"] > 0 and pack["lookahead_keys"] > 0
    code, out, err = invoke("run", str(model), *GREEDY, "-ub", "1", "--pack", "--cache-slots", "4",
                            "--ram-cache-mib", "auto", "--stats-json", str(stats_path))
    assert code == 0, err
    assert out == plain and json.loads(stats_path.read_text())["pack"]["ram_slots"] > 0  # sized from spare RAM
    code, out, err = invoke("run", str(model), *GREEDY, "-ub", "1", "--pack", "--cache-slots", "4",
                            "--ram-cache-mib", "auto", "--ram-preload", "--stats-json", str(stats_path))
    assert code == 0, err
    pack = json.loads(stats_path.read_text())["pack"]
    assert out == plain and pack["ram_preloaded"] == pack["ram_slots"] > 0  # the tier filled at start-up...
    assert pack["pack_read_bytes"] == 0 and pack["ram_misses"] == 0  # ...so no token waited on the SSD


def test_run_chat_reads_lines_until_empty(models, tmp_path):
    model, pack = models[0]
    stats_path = tmp_path / "stats.json"
    code, out, err = invoke("run", str(model), "--pack", "--chat", "-n", "6", "--temp", "0", "-c", "512",
                            "-p", "You are terse.", "--stats-json", str(stats_path),
                            input="Hello there\nTell me a story\n\nnever sent\n")
    assert code == 0, err
    assert out.strip()
    stats = json.loads(stats_path.read_text())
    assert stats["n_requests"] == 2
    assert 2 <= stats["n_generated"] <= 12 and stats["pack"]["acquires"] > 0
    check_stats_lines(err, "expert cache: hit rate ")


def test_runner_streams_pieces(models):
    from llamapack.run import Runner, open_model

    model, pack = models[0]
    with open_model(str(model), pack=str(pack), n_ctx=256, n_threads=2, verbose=False) as llm:
        runner = Runner(llm)
        pieces = list(runner.complete(PROMPT, max_tokens=8, temperature=0))
        assert len(pieces) > 1 and all(isinstance(p, str) for p in pieces)
        assert "".join(pieces) == llm.create_completion(PROMPT, max_tokens=8, temperature=0)["choices"][0]["text"]
        stats = runner.stats
        assert (stats.n_requests, stats.n_prompt, stats.n_generated, stats.n_decoded) == (1, 4, 8, 7)
        assert "eval" not in vars(llm)  # the timing wrapper is gone after the request


ERROR_CASES = {
    "nonexistent model": (lambda m, tmp: [str(tmp / "none.gguf"), "-p", "x"], "Error: GGUF file not found"),
    "pack of another model": (lambda m, tmp: [str(m[0][0]), "--pack", str(m[1][1]), "-p", "x"],
                              "Error: pack does not match the model"),
    "missing pack": (lambda m, tmp: [str(m[0][0]), "--pack", str(tmp / "none.expert-pack"), "-p", "x"],
                     "Error: manifest not found"),
    "prefetch without a pack": (lambda m, tmp: [str(m[0][0]), "--prefetch", "-p", "x"],
                                "Error: --prefetch needs --pack or --gguf-direct"),
    "preload without a RAM tier": (lambda m, tmp: [str(m[0][0]), "--pack", "--ram-preload", "-p", "x"],
                                   "Error: --ram-preload fills the RAM tier: give --ram-cache-mib"),
    "cache too small": (lambda m, tmp: [str(m[0][0]), "--pack", "--cache-slots", "1", "-ub", "512", "-p", "x"],
                        "Error: the expert cache holds 1 experts"),
    "prompt longer than the context": (lambda m, tmp: [str(m[0][0]), "--pack", "-c", "256", "-p", "word " * 600],
                                       "Error: the prompt is 601 tokens; the context holds 256"),
    "empty prompt": (lambda m, tmp: [str(m[0][0]), "--pack", "-p", ""], "Error: the prompt is empty"),
    "prompt not UTF-8": (lambda m, tmp: [str(m[0][0]), "--pack", "-p", os.fsdecode(b"a\xff")],
                         "Error: the prompt is not valid UTF-8 (byte 0xff at character 1)"),
    "no-direct-io without a pack": (lambda m, tmp: [str(m[0][0]), "--no-direct-io", "-p", "x"],
                                    "Error: --no-direct-io needs --pack or --gguf-direct"),
}


@pytest.mark.parametrize("how", ["clirunner", "subprocess"])
@pytest.mark.parametrize("case", list(ERROR_CASES))
def test_run_errors_are_one_line(models, tmp_path, case, how):
    make_args, expected = ERROR_CASES[case]
    args = ["run", *make_args(models, tmp_path)]
    if how == "clirunner":
        code, out, err = invoke(*args)
    else:
        proc = python_m(*args)
        code, out, err = proc.returncode, proc.stdout, proc.stderr
    assert code != 0
    assert err.startswith(expected) and err.count("\n") == 1, err
    assert "Traceback" not in out + err and "Exception ignored" not in err


@pytest.mark.parametrize("size", ["lots", "0", "-5", "inf"])
def test_a_bad_ram_tier_size_is_a_usage_error(models, size):
    code, out, err = invoke("run", str(models[0][0]), "--pack", "--ram-cache-mib", size, "-p", "x")
    assert code == 2 and f"Invalid value for '--ram-cache-mib': '{size}' is neither a size in MiB above 0" in err
    assert "Traceback" not in out + err


@pytest.mark.parametrize("option, value", [("--cache-vram-mib", "inf"), ("--cache-vram-mib", "nan"),
                                           ("--temp", "nan"), ("--temp", "inf")])
def test_a_number_that_is_not_finite_is_a_usage_error(models, option, value):
    code, out, err = invoke("run", str(models[0][0]), "--pack", option, value, "-p", "x")
    assert code == 2 and f"Invalid value for '{option}': '{value}' is not a finite number" in err
    assert "Traceback" not in out + err


def test_cache_slots_beyond_the_model_are_capped_and_no_direct_io_runs(models, tmp_path):
    model, pack = models[0]
    stats_path = tmp_path / "stats.json"
    code, plain, err = invoke("run", str(model), *GREEDY, "--pack")
    assert code == 0, err
    code, out, err = invoke("run", str(model), *GREEDY, "--pack", "--cache-slots", "100000000", "--no-direct-io",
                            "--stats-json", str(stats_path))
    assert code == 0, err
    assert out == plain and json.loads(stats_path.read_text())["pack"]["n_slots"] == 4 * 16  # layers x experts


def test_chat_line_not_utf8_is_one_line_error(models):
    proc = subprocess.run([sys.executable, "-m", "llamapack", "run", str(models[0][0]), "--pack", "--chat", "-n", "2"],
                          input=b"Hello\n\xff\xfe\n", capture_output=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    err = proc.stderr.decode()
    assert proc.returncode == 1 and "Traceback" not in err, err
    assert err.splitlines()[-1].startswith("Error: ") and "not valid UTF-8" in err.splitlines()[-1]


def test_demo_reports_identical(tmp_path):
    proc = python_m("demo", "-n", "8", LLAMAPACK_CACHE=str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[-2:] == ["tokens identical: yes", "logits identical: yes"]
    assert any(line.startswith("decode: 8 tokens in ") for line in lines)
    assert any(line.startswith("expert cache: hit rate ") for line in lines)
    assert (tmp_path / "demo" / "qwen3moe-tiny.expert-pack").exists()
    assert "Traceback" not in proc.stderr


def test_synth_is_registered(tmp_path):
    code, out, err = invoke("synth", "--list")
    assert code == 0, err
    assert "qwen3moe-tiny" in out


def test_run_hybrid_writes_the_same_text_and_reports_the_cpu_rows(models, tmp_path):
    """On a CPU build both of hybrid's paths are ggml's CPU kernels: the same tokens as without it."""
    model, _ = models[0]
    stats_path = tmp_path / "stats.json"
    base = ["run", str(model), *GREEDY, "-ub", "1", "--pack", "--cache-slots", "4", "--ram-cache-mib", "64"]
    code, plain, err = invoke(*base)
    assert code == 0, err
    code, out, err = invoke(*base, "--hybrid", "on", "--hybrid-threads", "2", "--stats-json", str(stats_path))
    assert code == 0, err
    assert out == plain
    pack = json.loads(stats_path.read_text())["pack"]
    assert pack["hybrid"]["mode"] == "on" and pack["hybrid"]["threads"] == 2 and pack["hybrid"]["upload_share"] == 0
    assert pack["cpu_experts"] > 0
    assert f"hybrid on: {pack['cpu_experts']} expert rows on 2 CPU threads" in err


@pytest.mark.parametrize("args, expected", [
    (["--hybrid", "on"], "Error: --hybrid computes misses from the RAM tier: give --ram-cache-mib (MiB or auto)"),
    (["--ram-cache-mib", "64", "--hybrid-threads", "2"], "Error: --hybrid-threads sizes hybrid's CPU pool: give --hybrid too"),
])
def test_hybrid_options_without_what_they_need_are_one_line_errors(models, args, expected):
    code, out, err = invoke("run", str(models[0][0]), "--pack", *args, "-p", "x")
    assert code == 1 and err.startswith(expected) and err.count("\n") == 1, err


@pytest.mark.parametrize("value", ["sometimes", "1.5", "-0.1"])
def test_a_bad_hybrid_mode_is_a_usage_error(models, value):
    code, out, err = invoke("run", str(models[0][0]), "--pack", "--ram-cache-mib", "64", "--hybrid", value, "-p", "x")
    assert code == 2 and "Invalid value for '--hybrid': " in err and "Traceback" not in out + err
