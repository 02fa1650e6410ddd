"""`stepdeploy data prepare`: local text files -> a megatron-core indexed dataset a run can train on.

Exit codes: 0 written, 2 bad input (a missing, special, empty or non-UTF-8 input, a bad JSONL line, a tokenizer
that cannot be read, an existing output name (a planted symbolic link included), an output path through another
user's symbolic link in a shared directory such as /tmp)."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.progress import BarColumn, DownloadColumn, Progress, TaskID, TextColumn, TimeRemainingColumn

from stepdeploy import corpus
from stepdeploy.cli.output import emit_json, err, info, out

EXAMPLE = ("Example: stepdeploy data prepare texts/ --train-tokenizer 4096 --out data/corpus\n\n"
           "texts/: a directory of your own text files. Other tokenizers: --tokenizer path/to/tokenizer.json "
           "(a Hugging Face tokenizer, read offline), --tokenizer byte (the default).")
app = typer.Typer(help="Training data: tokenize local text into megatron-core's indexed dataset format.",
                  no_args_is_help=True, rich_markup_mode=None, epilog=EXAMPLE)


@app.command("prepare", epilog=EXAMPLE)
def prepare(
    inputs: list[Path] = typer.Argument(..., help="Text files (one document each), .jsonl files (one JSON object "
                                        "per line), or directories of them (every file in them)."),
    out_prefix: Path = typer.Option(..., "--out", "-o", help="Output prefix DIR/NAME: writes NAME.bin, .idx, .json "
                                    "(and .tokenizer.json) in DIR, which is made if missing."),
    tokenizer: str | None = typer.Option(None, "--tokenizer", help="`byte` (each byte a token, 256 ends a "
                                         "document; the default), or a Hugging Face tokenizer.json (or a "
                                         "directory holding one)."),
    train_tokenizer: int | None = typer.Option(None, "--train-tokenizer", metavar="N", help="Instead of --tokenizer: "
                                        "train a byte-level BPE of N tokens on the inputs themselves (deterministic; "
                                        "nothing downloaded)."),
    json_key: str = typer.Option("text", "--json-key", help="The field of each .jsonl object that holds the text."),
    eod_token: str | None = typer.Option(None, "--eod-token", help="With --tokenizer PATH: the token that ends a "
                                         "document (default: the first of <|endoftext|>, <|end_of_text|>, </s>, "
                                         "<eos> it has)."),
    as_json: bool = typer.Option(False, "--json", help="Print the dataset's description as JSON to stdout."),
) -> None:
    """Tokenize local text, one document per file (per line of a .jsonl file), into PREFIX.bin/.idx
    (megatron-core's indexed dataset, read by its GPTDataset) and PREFIX.json (the tokenizer, its vocabulary,
    the largest id, checksums). A real tokenizer is saved beside it as PREFIX.tokenizer.json. A model trains on it
    when its vocab_size holds the tokenizer's vocabulary padded to a multiple of 128 (as Megatron pads it)."""
    with Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TimeRemainingColumn(),
                  console=err, transient=True) as progress:
        tasks: dict[str, TaskID] = {}

        def report(what: str, done: int, total: int) -> None:
            if what not in tasks:
                tasks[what] = progress.add_task(what, total=total)
            progress.update(tasks[what], completed=done, total=total)

        made = corpus.prepare(inputs, out_prefix, report, tokenizer=tokenizer, train_tokenizer=train_tokenizer,
                              json_key=json_key, eod_token=eod_token)
    if as_json:
        emit_json(made.to_json())
        return
    tok = made.tokenizer
    extra = f" + {tok.file}" if tok.file else ""
    out.print(f"wrote {made.prefix}.bin/.idx/.json{extra}: {made.documents:,} document(s), {made.tokens:,} tokens; "
              f"tokenizer {tok.name} ({tok.kind}) of {made.vocab:,} ids, end of document {made.eod}, largest id "
              f"{made.max_id}; a model needs a vocab_size of at least {made.padded_vocab:,}", markup=False)
    info(f"next: stepdeploy render ... --data {made.prefix}")
