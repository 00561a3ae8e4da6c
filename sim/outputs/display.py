"""Units for people: every table, timeline and README figure shows bytes in GiB (2**30, as
``torch.cuda.memory_summary`` and torchtitan print them) and times in milliseconds. JSON and CSV
stay in bytes and seconds."""

BYTES_PER_GIB = float(1 << 30)
MS_PER_S = 1e3


def gib(nbytes: float) -> str:
    """``12.34 GiB``."""
    return f"{nbytes / BYTES_PER_GIB:,.2f} GiB"


def ms(seconds: float, digits: int = 2) -> str:
    """``123.45 ms``."""
    return f"{seconds * MS_PER_S:,.{digits}f} ms"


def fmt_bytes(n: float) -> str:
    """A binary size in the largest unit that keeps it above 1 (B, KiB, MiB, GiB)."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} GiB"
