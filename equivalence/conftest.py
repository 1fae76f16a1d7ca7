import pytest


def pytest_collection_modifyitems(config, items):
    # Everything under equivalence/ is part of `pytest -m equivalence`.
    for item in items:
        if "/equivalence/" in str(item.fspath).replace("\\", "/"):
            item.add_marker(pytest.mark.equivalence)
