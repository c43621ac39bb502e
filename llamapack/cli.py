"""``llamapack`` command line. Commands only parse arguments and call the library.

Any ``LlamapackError`` becomes a one-line ``Error: ...`` on stderr and exit status 1 (handled once,
in ``LlamapackGroup``, so commands added later get the same behaviour).
"""

from __future__ import annotations

import click

from llamapack.errors import LlamapackError


class LlamapackGroup(click.Group):
    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except LlamapackError as exc:
            raise click.ClickException(" ".join(str(exc).split())) from None


@click.group(cls=LlamapackGroup)
def main() -> None:
    """Run MoE LLMs with routed experts streamed from NVMe."""


@main.command()
@click.argument("model", type=click.Path(dir_okay=False))
@click.option("-o", "--output", type=click.Path(dir_okay=False), help="Pack path (default: <stem>.expert-pack beside MODEL).")
@click.option("--safety-margin-mib", type=click.IntRange(min=0), default=1024, show_default=True,
              help="Free space to leave on the target filesystem.")
@click.option("--full-hash", is_flag=True, help="Fingerprint the source GGUF with a full sha256 (slow) instead of sampling.")
@click.option("--no-direct-io", is_flag=True, help="Write with buffered I/O (for filesystems without O_DIRECT).")
@click.option("-q", "--quiet", is_flag=True, help="No progress bar.")
def pack(model: str, output: str | None, safety_margin_mib: int, full_hash: bool, no_direct_io: bool, quiet: bool) -> None:
    """Build the expert pack of MODEL.gguf."""
    from llamapack.pack import build_pack
    from llamapack.pack.identity import FULL, SAMPLED

    result = build_pack(model, output, safety_margin_mib=safety_margin_mib, progress=not quiet,
                        direct_io=not no_direct_io, fingerprint_mode=FULL if full_hash else SAMPLED)
    layout = result.manifest.layout
    rate = layout.num_blocks * layout.expert_stride / max(result.seconds, 1e-9) / 1e9
    click.echo(f"wrote {result.pack_path} ({layout.pack_size / 1e9:.3f} GB, {len(layout.layers)} layers x "
               f"{layout.num_experts} experts, stride {layout.expert_stride}, {rate:.2f} GB/s) "
               f"and {result.manifest_path}")


@main.command()
@click.argument("path", type=click.Path(dir_okay=False))
def inspect(path: str) -> None:
    """Summarize a pack (or its manifest), or the pack layout of a GGUF."""
    from llamapack.pack import inspect as inspect_pack

    for line in inspect_pack(path).lines():
        click.echo(line)


@main.command()
@click.argument("pack_path", metavar="PACK", type=click.Path(dir_okay=False))
@click.option("--against", type=click.Path(dir_okay=False), help="Also compare every block with this GGUF's bytes.")
@click.option("--no-direct-io", is_flag=True, help="Read with buffered I/O.")
@click.option("-q", "--quiet", is_flag=True, help="No progress bar.")
def verify(pack_path: str, against: str | None, no_direct_io: bool, quiet: bool) -> None:
    """Check every block of PACK against its manifest (and a GGUF)."""
    from llamapack.pack import verify as verify_pack

    report = verify_pack(pack_path, against=against, progress=not quiet, direct_io=not no_direct_io)
    extra = f" and match {report.against}" if report.against else ""
    click.echo(f"OK: {report.blocks} blocks ({report.nbytes / 1e9:.3f} GB) pass sha256{extra} "
               f"in {report.seconds:.1f} s")
