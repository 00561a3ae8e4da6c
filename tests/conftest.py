"""The files with real multi-process runs (a test marked ``slow``) are collected first, so that
under ``make test`` (``pytest -n 2 --dist loadfile``) the two workers start on the long files and
finish together instead of one running the last long file alone."""

import pytest


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    slow_files = {item.path for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.path not in slow_files)  # stable: each file keeps its order
