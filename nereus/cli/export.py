"""`nereus export`: a training run's model as a Hugging Face checkpoint.

    nereus export runs/arith --hf out/arith-hf [--step 40] [--model actor]

Reads OUT/checkpoints/step_N (the latest complete one unless --step), writes config.json,
safetensors shards and the tokenizer's files (nereus.rl.export). transformers'
`from_pretrained(DIR)` loads the folder (its config.json is the one the vLLM engine path
writes for its engines).
"""

from __future__ import annotations

import json

import click

from nereus.cli.errors import reports_errors, traceback_option


@click.command("export")
@click.argument("out", type=click.Path(exists=True, file_okay=False))
@click.option("--hf", "target", required=True, help="Folder to write the Hugging Face checkpoint into.")
@click.option("--step", type=int, default=None, help="Checkpoint step (default: the latest complete one).")
@click.option("--model", "model_name", default="actor", show_default=True, help="Model of the plan file to export.")
@click.option("--max-shard-size", "max_shard_mb", type=int, default=2048, show_default=True,
              help="Largest safetensors file in MiB (more weights: model-0000i-of-0000n shards and an index).")
@click.option("--json", "as_json", is_flag=True, help="Print what was written as one JSON line.")
@traceback_option
@reports_errors
def export_command(out, target, step, model_name, max_shard_mb, as_json, traceback):
    """Write a training run's model (default: the actor) as a Hugging Face checkpoint.

    \b
    nereus export runs/arith --hf out/arith-hf
    nereus export runs/arith --hf out/arith-hf --step 20 --model ref
    """
    from nereus.ir.diagnostics import NereusError
    from nereus.rl.export import export_hf

    if max_shard_mb < 1:
        raise NereusError(f"--max-shard-size {max_shard_mb}: must be at least 1 (MiB)")
    written = export_hf(out, target, step=step, model_name=model_name, max_shard_bytes=max_shard_mb << 20)
    if as_json:
        click.echo(json.dumps(written))
    else:
        click.echo(f"step {written['step']}: {written['model']} -> {target} ({', '.join(written['files'])}, "
                   f"{written['bytes']} bytes; tokenizer files: {', '.join(written['tokenizer_files']) or 'none'})")
