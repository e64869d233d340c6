"""CSV / TSV / plain text -> SFT JSONL (``{"instruction", "input", "output"}`` per line).

    python -m megacann.data.convert --input qa.csv --output train.jsonl \\
        [--instruction_column question] [--input_column context] [--output_column answer]
    python -m megacann.data.convert --input pairs.txt --output train.jsonl [--separator '\\t']

CSV and TSV files need a header row; without column options the instruction column is the first of
instruction / prompt / question / query / input, the output column the first of output / response /
answer / completion / target, and ``input`` (or ``context``) is used when present. A text file holds one
record per line, prompt and answer split at the first ``--separator`` (a tab by default; write ``\\n`` in
a field as the two characters backslash-n to keep it on one line). Rows with an empty instruction or
output are an error naming the file and line, unless ``--skip_bad_rows``.
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
from collections.abc import Iterator
from typing import Optional

from megacann.errors import MegacannError

INSTRUCTION_NAMES = ("instruction", "prompt", "question", "query", "input")
OUTPUT_NAMES = ("output", "response", "answer", "completion", "target")
INPUT_NAMES = ("input", "context")


class ConvertError(MegacannError, ValueError):
    """An input row that cannot become an SFT record."""


def _pick(
    header: list[str], wanted: Optional[str], names: tuple[str, ...], what: str, path: str, exclude=()
) -> Optional[str]:
    if wanted is not None:
        if wanted not in header:
            raise ConvertError(f"{path}: column {wanted!r} ({what}) not in the header {header}")
        return wanted
    lowered = {h.lower().strip(): h for h in header if h not in exclude}
    return next((lowered[n] for n in names if n in lowered), None)


def csv_records(
    path: str, instruction: Optional[str], input_col: Optional[str], output: Optional[str]
) -> Iterator[tuple[int, dict]]:
    """(line number, record) for each data row of a CSV (or TSV, by extension) file."""
    with open(path, newline="", encoding="utf-8") as f:
        reader = csv.DictReader(f, delimiter="\t" if path.endswith(".tsv") else ",")
        header = list(reader.fieldnames or [])
        i_col = _pick(header, instruction, INSTRUCTION_NAMES, "instruction", path)
        o_col = _pick(header, output, OUTPUT_NAMES, "output", path)
        if i_col is None or o_col is None:
            raise ConvertError(
                f"{path}: cannot tell the instruction and output columns from the header {header}; "
                f"name them with --instruction_column and --output_column"
            )
        x_col = _pick(header, input_col, INPUT_NAMES, "input", path, exclude=(i_col, o_col))
        for row in reader:
            record = {
                "instruction": row.get(i_col) or "",
                "input": (row.get(x_col) or "") if x_col else "",
                "output": row.get(o_col) or "",
            }
            yield reader.line_num, record


def text_records(path: str, separator: str) -> Iterator[tuple[int, dict]]:
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, start=1):
            line = line.rstrip("\n")
            if not line.strip():
                continue
            prompt, sep, answer = line.partition(separator)
            if not sep:
                raise ConvertError(f"{path}:{line_no}: no separator {separator!r} between prompt and answer")
            unescape = lambda s: s.replace("\\n", "\n").strip()
            yield line_no, {"instruction": unescape(prompt), "input": "", "output": unescape(answer)}


def convert(
    inputs: list[str],
    output: str,
    separator: str = "\t",
    columns: tuple = (None, None, None),
    skip_bad_rows: bool = False,
) -> dict:
    """Write every record of ``inputs`` to ``output`` (JSONL); returns counts."""
    written = skipped = 0
    with open(output, "w", encoding="utf-8") as out:
        for path in inputs:
            rows = csv_records(path, *columns) if path.endswith((".csv", ".tsv")) else text_records(path, separator)
            for line_no, record in rows:
                if not record["instruction"].strip() or not record["output"].strip():
                    if not skip_bad_rows:
                        raise ConvertError(
                            f"{path}:{line_no}: empty instruction or output (use --skip_bad_rows to skip)"
                        )
                    skipped += 1
                    continue
                out.write(json.dumps(record, ensure_ascii=False) + "\n")
                written += 1
    return {"written": written, "skipped": skipped}


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m megacann.data.convert", description="CSV/TSV/text -> SFT JSONL")
    p.add_argument("--input", action="append", required=True, help="a .csv, .tsv or text file (repeatable)")
    p.add_argument("--output", required=True, help="the JSONL file to write")
    p.add_argument("--separator", default="\t", help="prompt/answer separator of text files (default: tab)")
    p.add_argument("--instruction_column")
    p.add_argument("--input_column")
    p.add_argument("--output_column")
    p.add_argument("--skip_bad_rows", action="store_true")
    args = p.parse_args(argv)
    columns = (args.instruction_column, args.input_column, args.output_column)
    try:
        counts = convert(args.input, args.output, args.separator.replace("\\t", "\t"), columns, args.skip_bad_rows)
    except (ConvertError, OSError, csv.Error) as err:
        print(f"convert: error: {err}", file=sys.stderr)
        return 1
    print(f"wrote {counts['written']} records to {args.output} ({counts['skipped']} rows skipped)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
