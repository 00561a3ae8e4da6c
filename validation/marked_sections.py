"""Rewriting one marked section of a Markdown file (VALIDATION.md), the rest of the file kept.

The matrix run by systems, ``validation.offload_memory``, the published runs
(``validation.published``) and the GPU run (``validation.gpu``) each own one section of
VALIDATION.md, between ``<!-- key:begin -->`` and ``<!-- key:end -->``, so that a partial run
replaces its own figures and no one else's.
"""

from pathlib import Path

from sim.fileio import write_text_atomic


def markers(key: str) -> tuple[str, str]:
    """The comments that open and close section ``key``."""
    return f"<!-- {key}:begin -->", f"<!-- {key}:end -->"


def section_span(text: str, key: str, where: str) -> tuple[int, int]:
    """Where the text between ``key``'s markers lies in ``text`` (its own lines: the newline after
    the begin marker and the one before the end marker excluded); ``where`` names the file in the
    ValueError raised unless there is exactly one pair, in that order."""
    opening, closing = markers(key)
    begin, end = opening + "\n", "\n" + closing
    if text.count(begin) != 1 or text.count(end) != 1 or text.index(begin) > text.index(end):
        raise ValueError(f"{where} needs exactly one {begin.strip()} ... {end.strip()} pair, in that order")
    return text.index(begin) + len(begin), text.index(end)


def write_between_markers(path: str, key: str, section: str) -> None:
    """Replace the section between ``<!-- key:begin -->`` and ``<!-- key:end -->`` in ``path``
    (appended the first time), keeping the rest of the file."""
    begin, end = markers(key)
    p = Path(path)
    text = p.read_text() if p.is_file() else ""
    block = f"{begin}\n{section.rstrip()}\n{end}"
    if begin in text and end in text:
        text = text[: text.index(begin)] + block + text[text.index(end) + len(end) :]
    else:
        text = text.rstrip() + "\n\n" + block + "\n"
    write_text_atomic(path, text)
