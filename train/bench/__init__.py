"""Benchmarks (``make bench``): figures written as JSON and as a markdown table."""

from __future__ import annotations

from pathlib import Path

from train.atomic import write_json_atomic, write_text_atomic


def save_result(out: Path, stem: str, result: dict, markdown: str) -> None:
    """``out/<stem>.json`` and ``out/<stem>.md``, each written atomically."""
    write_json_atomic(out / f"{stem}.json", result)
    write_text_atomic(out / f"{stem}.md", markdown)
