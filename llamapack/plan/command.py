"""``llamapack plan``: registered lazily by llamapack/cli.py; parses arguments and calls ``planner``."""
from __future__ import annotations

import json

import click

from .planner import make_plan, table_lines


@click.command("plan")
@click.argument("model", type=click.Path(dir_okay=False))
@click.option("--pack", "pack", is_flag=False, flag_value="", default=None, metavar="[PACK]",
              help="Experts read from PACK (no value: <stem>.expert-pack beside MODEL); default: from MODEL itself.")
@click.option("-c", "--ctx-size", type=click.IntRange(min=1), default=4096, show_default=True,
              help="Context the KV cache is sized for.")
@click.option("--no-gpu", "no_gpu", is_flag=True, help="Plan a host pool (CPU compute, as with -ngl 0) even with a GPU.")
@click.option("--json", "as_json", is_flag=True, help="Print the plan as JSON.")
@click.option("--reprobe", is_flag=True, help="Measure the disk, CPU and copy rates again (else cached per machine).")
@click.option("-q", "--quiet", is_flag=True, help="No progress bar.")
def plan_command(model: str, pack: str | None, ctx_size: int, no_gpu: bool, as_json: bool, reprobe: bool,
                 quiet: bool) -> None:
    """Predict decode and prefill speed of MODEL.gguf on this machine before loading it, and choose the expert
    cache, RAM tier and ubatch sizes (use them with `llamapack run/serve --auto`)."""
    plan = make_plan(model, pack, n_ctx=ctx_size, reprobe=reprobe, use_gpu=not no_gpu, progress=not quiet)
    if as_json:
        click.echo(json.dumps(plan.as_json(), indent=1))
        return
    for line in table_lines(plan):
        click.echo(line)
