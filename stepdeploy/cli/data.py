"""`stepdeploy data prepare`: local text files -> a megatron-core indexed dataset a run can train on.

Exit codes: 0 written, 2 bad input (missing files, an existing output, no such directory)."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

from stepdeploy import corpus
from stepdeploy.cli.output import emit_json, err, info, out

app = typer.Typer(help="Training data: tokenize local text into megatron-core's indexed dataset format.",
                  no_args_is_help=True, rich_markup_mode=None,
                  epilog="Example: stepdeploy data prepare README.md docs/ --out data/corpus")


@app.command("prepare", epilog="Example: stepdeploy data prepare README.md docs/ --out data/corpus")
def prepare(
    inputs: list[Path] = typer.Argument(..., help="Text files, or directories of them (every file in them)."),
    out_prefix: Path = typer.Option(..., "--out", "-o", help="Output prefix: writes PREFIX.bin, .idx and .json."),
    as_json: bool = typer.Option(False, "--json", help="Print the dataset's description as JSON to stdout."),
) -> None:
    """Tokenize byte-level (each byte a token, 256 ends a document; nothing downloaded), one document per file,
    into PREFIX.bin/.idx (megatron-core's indexed dataset, read by its GPTDataset) and PREFIX.json."""
    with Progress(TextColumn("tokenizing"), BarColumn(), MofNCompleteColumn(), console=err,
                  transient=True) as progress:
        task = progress.add_task("files", total=None)
        made = corpus.prepare(inputs, out_prefix, lambda done, total: progress.update(task, completed=done,
                                                                                         total=total))
    if as_json:
        emit_json(made.to_json())
        return
    out.print(f"wrote {made.prefix}.bin/.idx/.json: {made.documents} document(s), {made.tokens:,} tokens, "
              f"byte-level vocabulary of {made.vocab} (end of document {made.eod})", markup=False)
    info(f"next: stepdeploy render ... --data {made.prefix}")
