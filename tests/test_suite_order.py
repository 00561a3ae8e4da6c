"""``conftest.LONGEST_FIRST``, the files ``make test`` starts first, names files that exist, once
each, and the collection puts them first in its order."""

from pathlib import Path

from conftest import LONGEST_FIRST, pytest_collection_modifyitems

HERE = Path(__file__).resolve().parent


def test_the_longest_files_exist_once_each() -> None:
    assert [name for name in LONGEST_FIRST if not (HERE / name).is_file()] == []
    assert len(set(LONGEST_FIRST)) == len(LONGEST_FIRST)


class _Item:
    def __init__(self, name: str, test: str):
        self.path, self.test = HERE / name, test


def test_the_collection_starts_with_them_and_keeps_each_files_order() -> None:
    items = [_Item(n, t) for n, t in [("test_a.py", "1"), (LONGEST_FIRST[1], "x"), ("test_a.py", "2")]]
    items += [_Item(LONGEST_FIRST[0], "y"), _Item(LONGEST_FIRST[1], "z")]
    pytest_collection_modifyitems(items)  # type: ignore[arg-type]
    assert [(i.path.name, i.test) for i in items] == [
        (LONGEST_FIRST[0], "y"),
        (LONGEST_FIRST[1], "x"),
        (LONGEST_FIRST[1], "z"),
        ("test_a.py", "1"),
        ("test_a.py", "2"),
    ]


def test_make_test_keeps_the_collection_order() -> None:
    makefile = (HERE.parent / "Makefile").read_text()
    assert "--dist loadfile --no-loadscope-reorder" in makefile, "xdist would reorder by test count"
