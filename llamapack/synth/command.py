"""``llamapack synth``: write a synthetic MoE GGUF (registered by llamapack/cli.py)."""

from __future__ import annotations

from pathlib import Path

import click

from .plan import expert_bytes, total_bytes
from .presets import PRESETS
from .writer import plan_model, write_model


def _list_presets() -> None:
    for name, spec in PRESETS.items():
        plans = plan_model(spec)
        click.echo(f"{name:22} {spec.arch:10} vocab={spec.vocab:10} {total_bytes(plans) / 2**20:9.1f} MiB "
                   f"(experts {expert_bytes(plans) / 2**20:.1f} MiB)  {spec.description}")


@click.command("synth")
@click.argument("preset", required=False, type=click.Choice(list(PRESETS)))
@click.option("-o", "--output", type=click.Path(dir_okay=False, path_type=Path), help="GGUF file to write.")
@click.option("--seed", default=0, show_default=True, help="Same seed, same bytes.")
@click.option("--router-skew", default=0.0, show_default=True, type=click.FloatRange(min=0.0),
              help="Zipf-like exponent making some experts per layer systematically hot; 0 = uniform.")
@click.option("--list", "list_only", is_flag=True, help="List the presets and their sizes, then exit.")
def synth_command(preset: str | None, output: Path | None, seed: int, router_skew: float, list_only: bool) -> None:
    """Write a synthetic MoE model PRESET (random weights, real tokenizer) to OUTPUT."""
    if list_only:
        _list_presets()
        return
    if preset is None or output is None:
        raise click.UsageError("give a PRESET and -o PATH (or --list)")
    path = write_model(output, preset, seed=seed, router_skew=router_skew, progress=True)
    click.echo(f"wrote {path} ({path.stat().st_size / 2**20:.1f} MiB)")
