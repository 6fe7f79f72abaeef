"""A comparable description of everything in the outbox schema."""

from __future__ import annotations

import psycopg

# Each query lists one kind of object in schema outbox, in a stable order.
_CATALOG_QUERIES = {
    "columns": """
        SELECT table_name, column_name, data_type, is_nullable, column_default, is_identity
        FROM information_schema.columns WHERE table_schema = 'outbox'
        ORDER BY table_name, ordinal_position""",
    "constraints": """
        SELECT conrelid::regclass::text, conname, pg_get_constraintdef(oid)
        FROM pg_constraint WHERE connamespace = 'outbox'::regnamespace
        ORDER BY 1, 2""",
    "indexes": """
        SELECT tablename, indexname, indexdef FROM pg_indexes
        WHERE schemaname = 'outbox' ORDER BY 1, 2""",
    "functions": """
        SELECT p.oid::regprocedure::text, pg_get_functiondef(p.oid)
        FROM pg_proc p WHERE p.pronamespace = 'outbox'::regnamespace ORDER BY 1""",
    "triggers": """
        SELECT tgrelid::regclass::text, tgname, pg_get_triggerdef(oid)
        FROM pg_trigger WHERE NOT tgisinternal
          AND tgrelid IN (SELECT oid FROM pg_class WHERE relnamespace = 'outbox'::regnamespace)
        ORDER BY 1, 2""",
    "comments": """
        SELECT c.relname, obj_description(c.oid, 'pg_class') FROM pg_class c
        WHERE c.relnamespace = 'outbox'::regnamespace ORDER BY 1""",
}


def snapshot(url: str) -> dict[str, list[tuple[object, ...]]]:
    with psycopg.connect(url) as conn:
        return {kind: conn.execute(query).fetchall() for kind, query in _CATALOG_QUERIES.items()}
