"""Docs that state numbers about the code say what the code says."""

from __future__ import annotations

from tests import inventory


def test_the_test_inventory_in_docs_testing_md_is_current():
    assert inventory.current() == inventory.block(), (
        "docs/testing.md's test inventory is stale: run `python -m tests.inventory --write`"
    )
