"""The scores' key column: the input's own key column name, so scores join back to the
input with no rename (a table keyed by `id` gets scores keyed by `id`).

An output keeps the name it started with: every file of one output, and every file of a
Delta table, has one schema. So the name is the one the output already uses (a Delta
table's schema; else its ledger entries, which record it), else the input's key column
(the training dataset's `pipelines.features.key`, which scoring reads). Outputs written
before scores kept the input's name call it `key` (their entries do not record it).
"""

from __future__ import annotations

OLD = "key"  # what every output of shardline before this rule names the key


def key_column(input_key: str, found: list, table_key: str | None = None) -> str:
    """found: the output's scores (serving.ledger.Scores) that stay after this run;
    table_key: a Delta output's key column, when the table exists."""
    if table_key:
        return table_key
    for s in found:
        for e in s.entries.values():
            return e.get("key_column", OLD)
    return input_key
