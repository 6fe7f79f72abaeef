"""Writes ``sql/schema.sql``: the outbox schema as the numbered migrations leave it.

The migrations are the source of truth, but after 28 of them the current definition of a
function is the last of several, and a trigger lives in whichever file last dropped and made it
again. This module reads the catalogs of a migrated database (``pg_get_functiondef``,
``pg_get_triggerdef``, ``pg_get_indexdef``, ``pg_get_constraintdef``, ``format_type``, ...) and
prints every object of schema ``outbox`` in a fixed order, grouped for a reader: the schema,
then each table with its columns, constraints, indexes, triggers, comments and privileges, then
the functions alphabetically, each with its full definition and the triggers that fire it.

By default it creates a scratch database on the server ``--dsn`` names, applies the migrations
one at a time (noting after each which objects it created or changed, for the ``-- history:``
lines), dumps it and drops it::

    python -m outbox.db.schema_dump --dsn postgresql://postgres@127.0.0.1:5432/postgres \\
        --output sql/schema.sql

``--existing`` dumps the database ``--dsn`` names as it stands instead (without history lines):
a deployed database compared with ``sql/schema.sql`` that way shows any drift.

Not pg_dump, whose output changes with the client's version and which prints objects in
dependency order. What would vary here is pinned instead: the session's search_path (names are
qualified the same way), DateStyle, IntervalStyle, TimeZone, extra_float_digits and bytea_output
(constants in defaults and conditions), Python's sort (no database collation decides the
order), the owner's name and its own privileges (PostgreSQL 17 adds MAINTAIN to a table
owner's), PostgreSQL 17's NULL for a default statistics target and 18's NOT NULL constraints.
What cannot be pinned is the text PostgreSQL itself deparses (defaults, CHECK and index
expressions, view bodies): a major version that deparses an expression differently changes the
file (15 and 16 give the same text).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import textwrap
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import psycopg
from psycopg import sql
from psycopg.conninfo import make_conninfo
from psycopg.rows import dict_row

from outbox.db import dsn as dsn_util
from outbox.db import migrations
from outbox.errors import OutboxError

SCHEMA: Final = "outbox"

# The command that regenerates sql/schema.sql, as the file's header and the test quote it.
REGENERATE: Final = (
    "python -m outbox.db.schema_dump --dsn postgresql://postgres@127.0.0.1:5432/postgres "
    "--output sql/schema.sql"
)

# The roles sql/roles.sql makes. Their grants are that script's (optional, cluster-wide, run
# per deployment), yet some migrations grant them EXECUTE on a new function where they exist
# already: left out, so the file does not depend on what else the server has seen.
ROLE_SCRIPT_ROLES: Final = frozenset(
    {"outbox_producer", "outbox_dispatcher", "outbox_operator", "outbox_consumer"}
)

# Deparsed constants follow these settings; pinned so that every session prints the same text.
_SESSION_SETTINGS: Final = (
    ("search_path", "pg_catalog, pg_temp"),
    ("DateStyle", "ISO, MDY"),
    ("IntervalStyle", "postgres"),
    ("TimeZone", "UTC"),
    ("extra_float_digits", "1"),
    ("bytea_output", "hex"),
    ("standard_conforming_strings", "on"),
    ("quote_all_identifiers", "off"),
)

_WIDTH: Final = 100
_CONSTRAINT_ORDER: Final = {"p": 0, "u": 1, "f": 2, "c": 3, "x": 4}
_COLUMN_OPTIONS: Final = frozenset({"n_distinct", "n_distinct_inherited"})
_SCRATCH_PREFIX: Final = "outbox_schema_dump_"
# Made by migrations.migrate itself, before the first numbered file.
_BY_THE_RUNNER: Final = "outbox migrate itself (outbox/db/migrations.py), before 0001"


class SchemaDumpError(OutboxError):
    """The schema holds something this module cannot print, or the database cannot be read."""


@dataclass(frozen=True, slots=True)
class Item:
    """One object of the dump: ``body`` is what tells two versions of it apart; ``notes`` are
    cross-references printed above it (the triggers that fire a function), not part of it."""

    key: str
    heading: str
    body: str
    notes: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class History:
    """Which migration created an object, and which changed it since."""

    created_by: str
    changed_by: tuple[str, ...] = ()


# --- catalog queries --------------------------------------------------------------------------
# Every query reads schema outbox (bound as %(schema)s) and returns names already quoted with
# quote_ident, so the Python side only arranges text.

_NAMESPACE: Final = "(SELECT oid FROM pg_namespace WHERE nspname = %(schema)s)"


def _privileges(acl: str, kind: str, owner: str) -> str:
    """A JSON list of [grantee, privilege, grantable] of everyone but the owner."""
    return f"""(SELECT coalesce(jsonb_agg(jsonb_build_array(
                    CASE WHEN a.grantee = 0 THEN 'PUBLIC' ELSE pg_get_userbyid(a.grantee) END,
                    a.privilege_type, a.is_grantable)), '[]'::jsonb)
             FROM aclexplode(coalesce({acl}, acldefault('{kind}', {owner}))) AS a
             WHERE a.grantee <> {owner})"""  # noqa: S608


_SCHEMA_QUERY: Final = f"""
SELECT quote_ident(n.nspname) AS name, pg_get_userbyid(n.nspowner) AS owner,
       obj_description(n.oid, 'pg_namespace') AS comment,
       {_privileges("n.nspacl", "n", "n.nspowner")} AS privileges,
       (SELECT coalesce(jsonb_agg(jsonb_build_array(
                   d.defaclobjtype, pg_get_userbyid(d.defaclrole), d.defaclacl::text)), '[]')
        FROM pg_default_acl d WHERE d.defaclnamespace = n.oid) AS default_privileges
FROM pg_namespace n WHERE n.nspname = %(schema)s
"""  # noqa: S608

_UNSUPPORTED_QUERY: Final = f"""
SELECT 'relation ' || c.relname::text || ' of kind ' || c.relkind::text FROM pg_class c
WHERE c.relnamespace = {_NAMESPACE} AND c.relkind NOT IN ('r', 'v', 'm', 'S', 'i', 'c')
UNION ALL
SELECT 'partition or inheritance child ' || c.relname FROM pg_class c
WHERE c.relnamespace = {_NAMESPACE}
  AND (c.relispartition OR EXISTS (SELECT FROM pg_inherits i WHERE i.inhrelid = c.oid))
UNION ALL
SELECT 'aggregate ' || p.oid::regprocedure::text FROM pg_proc p
WHERE p.pronamespace = {_NAMESPACE} AND p.prokind = 'a'
UNION ALL
SELECT 'type ' || t.typname || ' of kind ' || t.typtype::text FROM pg_type t
WHERE t.typnamespace = {_NAMESPACE} AND t.typtype NOT IN ('c', 'd', 'e')
  AND NOT EXISTS (SELECT FROM pg_type e WHERE e.typarray = t.oid)
UNION ALL
SELECT 'operator ' || o.oid::regoperator::text FROM pg_operator o
WHERE o.oprnamespace = {_NAMESPACE}
UNION ALL
SELECT 'operator family ' || f.opfname FROM pg_opfamily f WHERE f.opfnamespace = {_NAMESPACE}
UNION ALL
SELECT 'collation ' || c.collname FROM pg_collation c WHERE c.collnamespace = {_NAMESPACE}
UNION ALL
SELECT 'conversion ' || c.conname FROM pg_conversion c WHERE c.connamespace = {_NAMESPACE}
UNION ALL
SELECT 'text search configuration ' || c.cfgname FROM pg_ts_config c
WHERE c.cfgnamespace = {_NAMESPACE}
UNION ALL
SELECT 'text search dictionary ' || d.dictname FROM pg_ts_dict d
WHERE d.dictnamespace = {_NAMESPACE}
UNION ALL
SELECT 'extension ' || e.extname FROM pg_extension e WHERE e.extnamespace = {_NAMESPACE}
UNION ALL
SELECT 'event trigger ' || e.evtname FROM pg_event_trigger e
JOIN pg_proc p ON p.oid = e.evtfoid WHERE p.pronamespace = {_NAMESPACE}
"""  # noqa: S608

_RELATIONS_QUERY: Final = f"""
SELECT c.oid, c.relname, quote_ident(c.relname) AS name, c.relkind, c.relpersistence,
       c.reloptions, c.relrowsecurity, c.relforcerowsecurity, c.relreplident,
       am.amname, c.relowner = n.nspowner AS schema_owner, pg_get_userbyid(c.relowner) AS owner,
       obj_description(c.oid, 'pg_class') AS comment,
       {_privileges("c.relacl", "r", "c.relowner")} AS privileges,
       (SELECT jsonb_build_array(dep.refobjid::regclass::text, quote_ident(a.attname))
        FROM pg_depend dep
        JOIN pg_attribute a ON a.attrelid = dep.refobjid AND a.attnum = dep.refobjsubid
        WHERE dep.classid = 'pg_class'::regclass AND dep.objid = c.oid
          AND dep.refclassid = 'pg_class'::regclass AND dep.deptype IN ('a', 'i')) AS owned_by,
       CASE WHEN c.relkind IN ('v', 'm') THEN pg_get_viewdef(c.oid, true) END AS view_definition
FROM pg_class c
JOIN pg_namespace n ON n.oid = c.relnamespace
LEFT JOIN pg_am am ON am.oid = c.relam
WHERE n.nspname = %(schema)s AND c.relkind IN ('r', 'v', 'm', 'S')
"""  # noqa: S608

_COLUMNS_QUERY: Final = f"""
SELECT a.attrelid AS relid, a.attnum, a.attname, quote_ident(a.attname) AS name,
       format_type(a.atttypid, a.atttypmod) AS type, a.attnotnull,
       pg_get_expr(d.adbin, d.adrelid) AS default, a.attidentity, a.attgenerated,
       col_description(a.attrelid, a.attnum) AS comment,
       CASE WHEN a.attcollation <> t.typcollation
            THEN quote_ident(cn.nspname) || '.' || quote_ident(co.collname) END AS collation,
       CASE WHEN a.attstorage <> t.typstorage THEN a.attstorage::text END AS storage,
       nullif(a.attcompression::text, '') AS compression,
       a.attstattarget::integer AS statistics, a.attoptions,
       CASE WHEN a.attacl IS NOT NULL THEN
            (SELECT jsonb_agg(jsonb_build_array(
                        CASE WHEN x.grantee = 0 THEN 'PUBLIC' ELSE pg_get_userbyid(x.grantee) END,
                        x.privilege_type, x.is_grantable))
             FROM aclexplode(a.attacl) AS x WHERE x.grantee <> c.relowner) END AS privileges
FROM pg_attribute a
JOIN pg_class c ON c.oid = a.attrelid
JOIN pg_type t ON t.oid = a.atttypid
LEFT JOIN pg_attrdef d ON d.adrelid = a.attrelid AND d.adnum = a.attnum
LEFT JOIN pg_collation co ON co.oid = a.attcollation
LEFT JOIN pg_namespace cn ON cn.oid = co.collnamespace
WHERE c.relnamespace = {_NAMESPACE} AND c.relkind IN ('r', 'v', 'm', 'c')
  AND a.attnum > 0 AND NOT a.attisdropped
"""  # noqa: S608

_IDENTITY_QUERY: Final = f"""
SELECT dep.refobjid AS relid, dep.refobjsubid AS attnum, s.relname AS sequence,
       quote_ident(s.relname) AS name, format_type(q.seqtypid, NULL) AS type, q.seqstart,
       q.seqincrement, q.seqmax, q.seqmin, q.seqcache, q.seqcycle,
       {_privileges("s.relacl", "s", "s.relowner")} AS privileges
FROM pg_depend dep
JOIN pg_class s ON s.oid = dep.objid
JOIN pg_sequence q ON q.seqrelid = s.oid
WHERE dep.classid = 'pg_class'::regclass AND dep.refclassid = 'pg_class'::regclass
  AND dep.deptype = 'i' AND s.relnamespace = {_NAMESPACE}
"""  # noqa: S608

_SEQUENCE_QUERY: Final = """
SELECT q.seqrelid AS relid, format_type(q.seqtypid, NULL) AS type, q.seqstart, q.seqincrement,
       q.seqmax, q.seqmin, q.seqcache, q.seqcycle
FROM pg_sequence q WHERE q.seqrelid = %(relid)s
"""

# NOT NULL (PostgreSQL 18 keeps them here too) is printed with its column; a constraint
# trigger (contype t) with the triggers.
_CONSTRAINTS_QUERY: Final = f"""
SELECT con.conrelid AS relid, con.contypid AS typid, con.conname, quote_ident(con.conname) AS name,
       con.contype, pg_get_constraintdef(con.oid) AS definition,
       obj_description(con.oid, 'pg_constraint') AS comment
FROM pg_constraint con
WHERE con.connamespace = {_NAMESPACE} AND con.contype IN ('p', 'u', 'f', 'c', 'x')
"""  # noqa: S608

_INDEXES_QUERY: Final = f"""
SELECT i.indrelid AS relid, ic.relname, quote_ident(ic.relname) AS name,
       pg_get_indexdef(i.indexrelid) AS definition, i.indisclustered,
       obj_description(i.indexrelid, 'pg_class') AS comment,
       EXISTS (SELECT FROM pg_constraint con
               WHERE con.conindid = i.indexrelid AND con.conrelid = i.indrelid
                 AND con.contype IN ('p', 'u', 'x')) AS of_constraint
FROM pg_index i
JOIN pg_class ic ON ic.oid = i.indexrelid
WHERE ic.relnamespace = {_NAMESPACE}
"""  # noqa: S608

_TRIGGERS_QUERY: Final = f"""
SELECT t.tgrelid AS relid, t.tgname, quote_ident(t.tgname) AS name,
       pg_get_triggerdef(t.oid) AS definition, t.tgenabled::text AS enabled,
       obj_description(t.oid, 'pg_trigger') AS comment, t.tgfoid::regprocedure::text AS function
FROM pg_trigger t
JOIN pg_class c ON c.oid = t.tgrelid
WHERE c.relnamespace = {_NAMESPACE} AND NOT t.tgisinternal
"""  # noqa: S608

_POLICIES_QUERY: Final = f"""
SELECT p.polrelid AS relid, p.polname, quote_ident(p.polname) AS name, p.polcmd::text AS command,
       p.polpermissive,
       ARRAY(SELECT CASE WHEN r = 0 THEN 'PUBLIC' ELSE quote_ident(pg_get_userbyid(r)) END
             FROM unnest(p.polroles) AS r) AS roles,
       pg_get_expr(p.polqual, p.polrelid) AS using,
       pg_get_expr(p.polwithcheck, p.polrelid) AS check,
       obj_description(p.oid, 'pg_policy') AS comment
FROM pg_policy p
JOIN pg_class c ON c.oid = p.polrelid
WHERE c.relnamespace = {_NAMESPACE}
"""  # noqa: S608

_RULES_QUERY: Final = f"""
SELECT r.ev_class AS relid, r.rulename, pg_get_ruledef(r.oid) AS definition,
       obj_description(r.oid, 'pg_rewrite') AS comment
FROM pg_rewrite r
JOIN pg_class c ON c.oid = r.ev_class
WHERE c.relnamespace = {_NAMESPACE} AND r.rulename <> '_RETURN'
"""  # noqa: S608

_STATISTICS_QUERY: Final = f"""
SELECT s.stxrelid AS relid, s.stxname, pg_get_statisticsobjdef(s.oid) AS definition,
       obj_description(s.oid, 'pg_statistic_ext') AS comment
FROM pg_statistic_ext s WHERE s.stxnamespace = {_NAMESPACE}
"""  # noqa: S608

_TYPES_QUERY: Final = f"""
SELECT t.oid, t.typname, quote_ident(t.typname) AS name, t.typtype, t.typrelid,
       format_type(t.typbasetype, t.typtypmod) AS base, t.typnotnull, t.typdefault,
       CASE WHEN t.typcollation <> b.typcollation
            THEN quote_ident(cn.nspname) || '.' || quote_ident(co.collname) END AS collation,
       ARRAY(SELECT quote_literal(e.enumlabel) FROM pg_enum e
             WHERE e.enumtypid = t.oid ORDER BY e.enumsortorder) AS labels,
       t.typowner = n.nspowner AS schema_owner, pg_get_userbyid(t.typowner) AS owner,
       obj_description(t.oid, 'pg_type') AS comment,
       {_privileges("t.typacl", "T", "t.typowner")} AS privileges
FROM pg_type t
JOIN pg_namespace n ON n.oid = t.typnamespace
LEFT JOIN pg_type b ON b.oid = t.typbasetype
LEFT JOIN pg_collation co ON co.oid = t.typcollation
LEFT JOIN pg_namespace cn ON cn.oid = co.collnamespace
WHERE n.nspname = %(schema)s
  AND (t.typtype IN ('d', 'e')
       OR (t.typtype = 'c' AND (SELECT c.relkind FROM pg_class c WHERE c.oid = t.typrelid) = 'c'))
"""  # noqa: S608

_FUNCTIONS_QUERY: Final = f"""
SELECT p.oid::regprocedure::text AS signature, p.proname,
       pg_get_function_identity_arguments(p.oid) AS arguments, p.prokind::text AS kind,
       pg_get_functiondef(p.oid) AS definition,
       p.proowner = n.nspowner AS schema_owner, pg_get_userbyid(p.proowner) AS owner,
       obj_description(p.oid, 'pg_proc') AS comment,
       {_privileges("p.proacl", "f", "p.proowner")} AS privileges
FROM pg_proc p
JOIN pg_namespace n ON n.oid = p.pronamespace
WHERE n.nspname = %(schema)s AND p.prokind IN ('f', 'p', 'w')
"""  # noqa: S608


# --- reading ----------------------------------------------------------------------------------


def read_items(conn: psycopg.Connection[Any]) -> list[Item]:
    """Every object of schema outbox, in the order the file prints them."""
    with conn.transaction():
        for name, value in _SESSION_SETTINGS:
            conn.execute("SELECT pg_catalog.set_config(%s, %s, true)", (name, value))
        cur = conn.cursor(row_factory=dict_row)
        params = {"schema": SCHEMA}

        def rows(query: str) -> list[dict[str, Any]]:
            return cur.execute(query, params).fetchall()

        schemas = rows(_SCHEMA_QUERY)
        if not schemas:
            raise SchemaDumpError(f"the database has no schema {SCHEMA}: run `outbox migrate`")
        unsupported = sorted(row[0] for row in conn.execute(_UNSUPPORTED_QUERY, params))
        if unsupported:
            raise SchemaDumpError(
                "schema_dump cannot print these objects of schema outbox yet; teach it to: "
                + "; ".join(unsupported)
            )
        catalog = _Catalog(
            relations=rows(_RELATIONS_QUERY),
            columns=rows(_COLUMNS_QUERY),
            identities=rows(_IDENTITY_QUERY),
            constraints=rows(_CONSTRAINTS_QUERY),
            indexes=rows(_INDEXES_QUERY),
            triggers=rows(_TRIGGERS_QUERY),
            policies=rows(_POLICIES_QUERY),
            rules=rows(_RULES_QUERY),
            statistics=rows(_STATISTICS_QUERY),
            types=rows(_TYPES_QUERY),
            functions=rows(_FUNCTIONS_QUERY),
        )
        sequences = {
            r["relid"]: r
            for rel in catalog.relations
            if rel["relkind"] == "S"
            for r in cur.execute(_SEQUENCE_QUERY, {"relid": rel["oid"]}).fetchall()
        }
    return [_schema_item(schemas[0]), *catalog.items(sequences)]


@dataclass(frozen=True, slots=True)
class _Catalog:
    relations: list[dict[str, Any]]
    columns: list[dict[str, Any]]
    identities: list[dict[str, Any]]
    constraints: list[dict[str, Any]]
    indexes: list[dict[str, Any]]
    triggers: list[dict[str, Any]]
    policies: list[dict[str, Any]]
    rules: list[dict[str, Any]]
    statistics: list[dict[str, Any]]
    types: list[dict[str, Any]]
    functions: list[dict[str, Any]]

    def items(self, sequences: dict[int, dict[str, Any]]) -> list[Item]:
        by_name = sorted(self.relations, key=lambda r: r["relname"])
        tables = [r for r in by_name if r["relkind"] == "r"]
        views = [r for r in by_name if r["relkind"] in ("v", "m")]
        # Sequences of identity columns are printed with their column.
        identity_seqs = {r["sequence"] for r in self.identities}
        standalone = [
            r for r in by_name if r["relkind"] == "S" and r["relname"] not in identity_seqs
        ]
        fired_by: dict[str, list[str]] = {}
        for t in self.triggers:
            relname = next(r["name"] for r in self.relations if r["oid"] == t["relid"])
            fired_by.setdefault(t["function"], []).append(
                f"trigger {t['name']} ON {SCHEMA}.{relname}"
            )
        return [
            *(self._type_item(t) for t in sorted(self.types, key=lambda t: t["typname"])),
            *(self._sequence_item(s, sequences[s["oid"]]) for s in standalone),
            *(self._table_item(t) for t in tables),
            *(self._view_item(v) for v in views),
            *(
                _function_item(f, sorted(fired_by.get(f["signature"], [])))
                for f in sorted(self.functions, key=lambda f: (f["proname"], f["arguments"]))
            ),
        ]

    def _of(self, rows: list[dict[str, Any]], relid: int, key: str) -> list[dict[str, Any]]:
        return sorted((r for r in rows if r["relid"] == relid), key=lambda r: r[key])

    def _table_item(self, rel: dict[str, Any]) -> Item:
        qualified = f"{SCHEMA}.{rel['name']}"
        columns = self._of(self.columns, rel["oid"], "attnum")
        identities = {r["attnum"]: r for r in self.identities if r["relid"] == rel["oid"]}
        constraints = sorted(
            (c for c in self.constraints if c["relid"] == rel["oid"]),
            key=lambda c: (_CONSTRAINT_ORDER[c["contype"]], c["conname"]),
        )
        width = max((len(c["name"]) for c in columns), default=0)
        lines = [
            f"    {c['name'].ljust(width)} {_column(c, identities.get(c['attnum']), rel)}"
            for c in columns
        ]
        lines += [f"    CONSTRAINT {c['name']} {c['definition']}" for c in constraints]
        unlogged = "UNLOGGED " if rel["relpersistence"] == "u" else ""
        out = [
            f"CREATE {unlogged}TABLE {qualified} (",
            ",\n".join(lines),
            f"){_table_options(rel)};",
        ]
        after: list[str] = []
        for c in columns:
            after += _column_settings(qualified, c)
        if rel["relreplident"] != "d":
            identity = {"n": "NOTHING", "f": "FULL", "i": "USING INDEX"}[rel["relreplident"]]
            after.append(f"ALTER TABLE {qualified} REPLICA IDENTITY {identity};")
        if rel["relrowsecurity"]:
            after.append(f"ALTER TABLE {qualified} ENABLE ROW LEVEL SECURITY;")
        if rel["relforcerowsecurity"]:
            after.append(f"ALTER TABLE {qualified} FORCE ROW LEVEL SECURITY;")
        after += _comments(rel, columns, constraints, qualified, "TABLE")
        sections = ["\n".join(out), "\n".join(after)]
        sections.append(self._table_parts(rel, qualified))
        sections.append(
            "\n".join(
                [
                    _ownership(rel),
                    _privilege_line("privileges", rel["privileges"]),
                    *_column_privileges(columns),
                    *(
                        _privilege_line(f"privileges of sequence {SCHEMA}.{s['name']}", p)
                        for s in identities.values()
                        if (p := _visible(s["privileges"]))
                    ),
                ]
            ).strip("\n")
        )
        return Item(
            key=f"table {qualified}",
            heading=f"table {qualified}",
            body="\n\n".join(s for s in sections if s),
        )

    def _table_parts(self, rel: dict[str, Any], qualified: str) -> str:
        parts: list[str] = []
        for i in self._of(self.indexes, rel["oid"], "relname"):
            if not i["of_constraint"]:
                parts.append(i["definition"] + ";")
            if i["indisclustered"]:
                parts.append(f"ALTER TABLE {qualified} CLUSTER ON {i['name']};")
            if i["comment"] is not None:
                parts.append(f"COMMENT ON INDEX {SCHEMA}.{i['name']} IS {_literal(i['comment'])};")
        for s in self._of(self.statistics, rel["oid"], "stxname"):
            parts.append(s["definition"] + ";")
        for r in self._of(self.rules, rel["oid"], "rulename"):
            parts.append(r["definition"])
        for p in self._of(self.policies, rel["oid"], "polname"):
            parts.append(_policy(p, qualified))
        triggers = self._of(self.triggers, rel["oid"], "tgname")
        for t in triggers:
            parts.append(t["definition"] + ";")
            state = {"D": "DISABLE", "R": "ENABLE REPLICA", "A": "ENABLE ALWAYS"}.get(t["enabled"])
            if state is not None:
                parts.append(f"ALTER TABLE {qualified} {state} TRIGGER {t['name']};")
            if t["comment"] is not None:
                parts.append(
                    f"COMMENT ON TRIGGER {t['name']} ON {qualified} IS {_literal(t['comment'])};"
                )
        return "\n".join(parts)

    def _view_item(self, rel: dict[str, Any]) -> Item:
        qualified = f"{SCHEMA}.{rel['name']}"
        kind = "MATERIALIZED VIEW" if rel["relkind"] == "m" else "VIEW"
        columns = self._of(self.columns, rel["oid"], "attnum")
        definition = rel["view_definition"].rstrip().removesuffix(";")
        body = [f"CREATE {kind} {qualified}{_table_options(rel)} AS\n{definition};"]
        body += _comments(rel, columns, [], qualified, kind)
        body += [_ownership(rel), _privilege_line("privileges", rel["privileges"])]
        body += _column_privileges(columns)
        return Item(
            key=f"view {qualified}",
            heading=f"{kind.lower()} {qualified}",
            body="\n".join(line for line in body if line),
        )

    def _sequence_item(self, rel: dict[str, Any], seq: dict[str, Any]) -> Item:
        qualified = f"{SCHEMA}.{rel['name']}"
        body = [f"CREATE SEQUENCE {qualified}{_sequence_options(seq, always=True)};"]
        if rel["owned_by"] is not None:
            table, column = rel["owned_by"]
            body.append(f"ALTER SEQUENCE {qualified} OWNED BY {table}.{column};")
        body += _comments(rel, [], [], qualified, "SEQUENCE")
        body += [_ownership(rel), _privilege_line("privileges", rel["privileges"])]
        return Item(
            key=f"sequence {qualified}",
            heading=f"sequence {qualified}",
            body="\n".join(line for line in body if line),
        )

    def _type_item(self, t: dict[str, Any]) -> Item:
        qualified = f"{SCHEMA}.{t['name']}"
        if t["typtype"] == "e":
            body = [f"CREATE TYPE {qualified} AS ENUM ({', '.join(t['labels'])});"]
            kind = "TYPE"
        elif t["typtype"] == "d":
            spec = t["base"]
            if t["collation"] is not None:
                spec += f" COLLATE {t['collation']}"
            if t["typdefault"] is not None:
                spec += f" DEFAULT {t['typdefault']}"
            if t["typnotnull"]:
                spec += " NOT NULL"
            checks = sorted(
                (c for c in self.constraints if c["typid"] == t["oid"]),
                key=lambda c: c["conname"],
            )
            spec += "".join(f"\n    CONSTRAINT {c['name']} {c['definition']}" for c in checks)
            body = [f"CREATE DOMAIN {qualified} AS {spec};"]
            kind = "DOMAIN"
        else:
            fields = self._of(self.columns, t["typrelid"], "attnum")
            listed = ",\n".join(f"    {f['name']} {f['type']}" for f in fields)
            body = [f"CREATE TYPE {qualified} AS (\n{listed}\n);"]
            kind = "TYPE"
        if t["comment"] is not None:
            body.append(f"COMMENT ON {kind} {qualified} IS {_literal(t['comment'])};")
        body += [_ownership(t), _privilege_line("privileges", t["privileges"])]
        return Item(
            key=f"type {qualified}",
            heading=f"{kind.lower()} {qualified}",
            body="\n".join(line for line in body if line),
        )


def _schema_item(row: dict[str, Any]) -> Item:
    body = [f"CREATE SCHEMA {row['name']};"]
    if row["comment"] is not None:
        body.append(f"COMMENT ON SCHEMA {row['name']} IS {_literal(row['comment'])};")
    body.append(_privilege_line("privileges", row["privileges"]))
    for objtype, role, acl in sorted(row["default_privileges"]):
        shown = "the owner" if role == row["owner"] else role
        body.append(f"-- default privileges of {shown} for objects of kind {objtype}: {acl}")
    return Item(key=f"schema {row['name']}", heading=f"schema {row['name']}", body="\n".join(body))


def _function_item(row: dict[str, Any], fired_by: list[str]) -> Item:
    kind = "PROCEDURE" if row["kind"] == "p" else "FUNCTION"
    body = [row["definition"].rstrip("\n") + ";"]
    if row["comment"] is not None:
        body.append(f"COMMENT ON {kind} {row['signature']} IS {_literal(row['comment'])};")
    body += [_ownership(row), _privilege_line("privileges", row["privileges"])]
    return Item(
        key=f"function {row['signature']}",
        heading=f"{kind.lower()} {row['signature']}",
        body="\n".join(line for line in body if line),
        notes=tuple(f"fired by {t}" for t in fired_by),
    )


# --- pieces of text ---------------------------------------------------------------------------


def _literal(text: str) -> str:
    return "'" + text.replace("'", "''") + "'"


def _column(col: dict[str, Any], identity: dict[str, Any] | None, rel: dict[str, Any]) -> str:
    spec = str(col["type"])
    if col["collation"] is not None:
        spec += f" COLLATE {col['collation']}"
    if col["attgenerated"]:
        stored = "VIRTUAL" if col["attgenerated"] == "v" else "STORED"
        spec += f" GENERATED ALWAYS AS ({col['default']}) {stored}"
    elif col["default"] is not None:
        spec += f" DEFAULT {col['default']}"
    if col["attnotnull"]:
        spec += " NOT NULL"
    if col["attidentity"]:
        how = "ALWAYS" if col["attidentity"] == "a" else "BY DEFAULT"
        spec += f" GENERATED {how} AS IDENTITY"
        if identity is not None:
            options = []
            if identity["sequence"] != f"{rel['relname']}_{col['attname']}_seq":
                options.append(f"SEQUENCE NAME {SCHEMA}.{identity['name']}")
            options += _sequence_option_list(identity, always=False)
            if options:
                spec += f" ({' '.join(options)})"
    return spec


def _sequence_option_list(seq: dict[str, Any], *, always: bool) -> list[str]:
    """A sequence's options; only those that differ from CREATE SEQUENCE's defaults unless
    ``always``."""
    bits = {"smallint": 15, "integer": 31, "bigint": 63}.get(seq["type"], 63)
    ascending = seq["seqincrement"] > 0
    default_min, default_max = (1, 2**bits - 1) if ascending else (-(2**bits), -1)
    default_start = default_min if ascending else default_max
    options = []
    if always or seq["type"] != "bigint":
        options.append(f"AS {seq['type']}")
    for label, value, default in (
        ("INCREMENT BY", seq["seqincrement"], 1),
        ("MINVALUE", seq["seqmin"], default_min),
        ("MAXVALUE", seq["seqmax"], default_max),
        ("START WITH", seq["seqstart"], default_start),
        ("CACHE", seq["seqcache"], 1),
    ):
        if always or value != default:
            options.append(f"{label} {value}")
    if seq["seqcycle"]:
        options.append("CYCLE")
    return options


def _sequence_options(seq: dict[str, Any], *, always: bool) -> str:
    return "".join(f"\n    {o}" for o in _sequence_option_list(seq, always=always))


def _table_options(rel: dict[str, Any]) -> str:
    text = ""
    if rel["relkind"] in ("r", "m") and rel["amname"] not in (None, "heap"):
        text += f" USING {rel['amname']}"
    if rel["reloptions"]:
        text += f" WITH ({', '.join(sorted(rel['reloptions']))})"
    return text


def _column_settings(qualified: str, col: dict[str, Any]) -> list[str]:
    alter = f"ALTER TABLE {qualified} ALTER COLUMN {col['name']}"
    out = []
    if col["storage"] is not None:
        storage = {"p": "PLAIN", "e": "EXTERNAL", "m": "MAIN", "x": "EXTENDED"}[col["storage"]]
        out.append(f"{alter} SET STORAGE {storage};")
    if col["compression"] is not None:
        method = {"p": "pglz", "l": "lz4"}.get(col["compression"], col["compression"])
        out.append(f"{alter} SET COMPRESSION {method};")
    # -1 up to PostgreSQL 16, NULL from 17: the default either way.
    if col["statistics"] is not None and col["statistics"] >= 0:
        out.append(f"{alter} SET STATISTICS {col['statistics']};")
    # Only the options ALTER COLUMN ... SET accepts: some builds stamp attoptions with options
    # of their own (pg_attver=..., a new value on every run).
    options = sorted(o for o in col["attoptions"] or () if o.split("=")[0] in _COLUMN_OPTIONS)
    if options:
        out.append(f"{alter} SET ({', '.join(options)});")
    return out


def _comments(
    rel: dict[str, Any],
    columns: list[dict[str, Any]],
    constraints: list[dict[str, Any]],
    qualified: str,
    kind: str,
) -> list[str]:
    out = []
    if rel["comment"] is not None:
        out.append(f"COMMENT ON {kind} {qualified} IS {_literal(rel['comment'])};")
    for c in columns:
        if c["comment"] is not None:
            out.append(f"COMMENT ON COLUMN {qualified}.{c['name']} IS {_literal(c['comment'])};")
    for c in constraints:
        if c["comment"] is not None:
            out.append(
                f"COMMENT ON CONSTRAINT {c['name']} ON {qualified} IS {_literal(c['comment'])};"
            )
    return out


def _policy(p: dict[str, Any], qualified: str) -> str:
    text = f"CREATE POLICY {p['name']} ON {qualified}"
    if not p["polpermissive"]:
        text += " AS RESTRICTIVE"
    command = {"r": "SELECT", "a": "INSERT", "w": "UPDATE", "d": "DELETE"}.get(p["command"])
    if command is not None:
        text += f" FOR {command}"
    text += f"\n    TO {', '.join(sorted(p['roles']))}"
    if p["using"] is not None:
        text += f"\n    USING ({p['using']})"
    if p["check"] is not None:
        text += f"\n    WITH CHECK ({p['check']})"
    text += ";"
    if p["comment"] is not None:
        text += f"\nCOMMENT ON POLICY {p['name']} ON {qualified} IS {_literal(p['comment'])};"
    return text


def _ownership(row: dict[str, Any]) -> str:
    if row["schema_owner"]:
        return ""
    return f"-- owner: {row['owner']}, not the owner of schema {SCHEMA}"


def _visible(privileges: Iterable[Sequence[Any]]) -> list[tuple[str, str, bool]]:
    """The grants worth printing: not the role scripts' roles' (see ROLE_SCRIPT_ROLES)."""
    return sorted((str(g), str(p), bool(o)) for g, p, o in privileges if g not in ROLE_SCRIPT_ROLES)


def _privilege_line(what: str, privileges: Iterable[Sequence[Any]]) -> str:
    grants: dict[str, list[str]] = {}
    for grantee, privilege, grantable in _visible(privileges):
        grants.setdefault(grantee, []).append(
            privilege + (" WITH GRANT OPTION" if grantable else "")
        )
    if not grants:
        return f"-- {what}: the owner's only"
    listed = "; ".join(f"{g} {', '.join(p)}" for g, p in sorted(grants.items()))
    return f"-- {what}: the owner's, and {listed}"


def _column_privileges(columns: list[dict[str, Any]]) -> list[str]:
    return [
        _privilege_line(f"privileges on column {c['name']}", c["privileges"])
        for c in columns
        if c["privileges"] is not None and _visible(c["privileges"])
    ]


# --- the file -----------------------------------------------------------------------------------


def _header(latest: str | None, with_history: bool) -> str:
    state = f"every migration up to {latest}" if latest else "no migration"
    history = (
        "The `-- history:` line of each object names the migration that created it and those\n"
        "that changed it since: the files whose comments say why it is the way it is."
        if with_history
        else "Dumped from an existing database (--existing): no history lines."
    )
    return f"""\
-- sql/schema.sql: the outbox schema as the migrations of sql/ leave it
-- ({state}).
--
-- GENERATED FILE: DO NOT EDIT IT BY HAND. It is regenerated, after adding a migration, by
--     {REGENERATE}
-- (--dsn: any database of a server where you may CREATE DATABASE; the command makes a scratch
-- database there, migrates it, reads its catalogs and drops it). The numbered migrations remain
-- the source of truth: `outbox migrate` applies them, never this file, and
-- tests/integration/test_schema_file.py fails when the two disagree.
--
-- Read it for the current definition of anything: where a later migration replaced a function
-- or a trigger, this file has the one in force. It is not a script to run: objects are grouped
-- for reading (each table with its columns, constraints, indexes, triggers, comments and
-- privileges; then the functions alphabetically), not in the order PostgreSQL needs them.
{textwrap.indent(history, "-- ")}
--
-- Left out: rows (0019 writes the one row of outbox.limits; outbox.schema_migrations records
-- the migrations applied); the roles of sql/roles.sql and sql/roles_tenant_rls.sql and their
-- grants, policies and row-level security (optional, cluster-wide, applied per deployment by
-- `outbox migrate --with-roles`); owner names: every object belongs to the owner of schema
-- outbox, the role that ran the migrations, unless its `-- owner:` line says otherwise.
"""


def render(items: Sequence[Item], history: dict[str, History] | None, latest: str | None) -> str:
    """The text of sql/schema.sql."""
    out = [_header(latest, history is not None)]
    for item in items:
        lines = [f"-- {'=' * (_WIDTH - 3)}", f"-- {item.heading}"]
        if history is not None:
            lines += _history_lines(history.get(item.key))
        lines += [f"-- {note}" for note in item.notes]
        out.append("\n".join(lines) + "\n\n" + item.body + "\n")
    return "\n".join(out)


def _history_lines(known: History | None) -> list[str]:
    if known is None:
        return ["-- history: unknown"]
    text = f"history: created by {known.created_by}"
    if known.changed_by:
        text += "; changed by " + ", ".join(known.changed_by)
    return textwrap.wrap(text, _WIDTH, initial_indent="-- ", subsequent_indent="--     ")


def _latest(conn: psycopg.Connection[Any]) -> str | None:
    row = conn.execute(
        "SELECT version, name FROM outbox.schema_migrations ORDER BY version DESC LIMIT 1"
    ).fetchone()
    return None if row is None else f"{row[0]:04d}_{row[1]}"


def dump_existing(conn: psycopg.Connection[Any]) -> str:
    """The file for the database ``conn`` is connected to, as it stands (no history lines)."""
    items = read_items(conn)
    return render(items, None, _latest(conn))


def migrate_and_dump(dsn: str, migration_list: Sequence[migrations.Migration] | None = None) -> str:
    """Migrate the empty database ``dsn`` one migration at a time (all of ``sql/`` unless
    ``migration_list`` says otherwise), noting what each created or changed; then the file."""
    with (
        psycopg.connect(dsn, autocommit=True) as migrator,
        psycopg.connect(dsn, autocommit=True) as reader,
    ):
        exists = reader.execute(
            "SELECT 1 FROM pg_catalog.pg_namespace WHERE nspname = %s", (SCHEMA,)
        ).fetchone()
        if exists:
            raise SchemaDumpError(
                f"the database already has a schema {SCHEMA}: the history needs an empty one"
            )
        history: dict[str, History] = {}
        previous: dict[str, str] = {}

        def note(by: str) -> None:
            nonlocal previous
            current = {i.key: i.body for i in read_items(reader)}
            for key, body in current.items():
                if key not in previous:
                    history[key] = History(by)
                elif body != previous[key]:
                    known = history[key]
                    history[key] = History(known.created_by, (*known.changed_by, by))
            previous = current

        # Target 0: only what the runner makes before the first migration.
        migrations.migrate(migrator, target=0, migrations=migration_list)
        note(_BY_THE_RUNNER)
        migrations.migrate(migrator, migrations=migration_list, on_apply=lambda m: note(m.label))
        return render(read_items(reader), history, _latest(reader))


def scratch_dump(
    server_dsn: str, migration_list: Sequence[migrations.Migration] | None = None
) -> str:
    """:func:`migrate_and_dump` on a scratch database made on the server of ``server_dsn``."""
    name = f"{_SCRATCH_PREFIX}{uuid.uuid4().hex[:12]}"
    with psycopg.connect(server_dsn, autocommit=True) as admin:
        admin.execute(sql.SQL("CREATE DATABASE {} TEMPLATE template0").format(sql.Identifier(name)))
        try:
            return migrate_and_dump(make_conninfo(server_dsn, dbname=name), migration_list)
        finally:
            admin.execute(
                sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
            )


def _write(text: str, output: str) -> None:
    if output == "-":
        sys.stdout.write(text)
        return
    target = Path(output)
    # Whole or not at all: a failed run never leaves half a file.
    with tempfile.NamedTemporaryFile(
        "w", encoding="utf-8", dir=target.parent, prefix=f".{target.name}.", delete=False
    ) as tmp:
        tmp.write(text)
    Path(tmp.name).replace(target)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m outbox.db.schema_dump",
        description="Print the outbox schema as the migrations leave it (sql/schema.sql).",
    )
    parser.add_argument(
        "--dsn",
        help="a database of the server to make the scratch database on (default: "
        "$OUTBOX_DATABASE_URL); with --existing, the database to dump. No password: as every "
        "outbox command, it takes one only from the environment (outbox/cli/common.py)",
    )
    parser.add_argument(
        "--existing",
        action="store_true",
        help="dump the database --dsn names as it stands, without history lines",
    )
    parser.add_argument("--output", "-o", default="-", help="where to write it (default: stdout)")
    args = parser.parse_args(argv)
    if args.dsn is not None:
        # A password on the command line is visible to every user of this machine (ps,
        # /proc/<pid>/cmdline) and stays in shell histories: refused, as outbox's CLI does.
        try:
            with_password = dsn_util.has_password(args.dsn)
        except ValueError as exc:
            parser.error(f"--dsn: {exc}")
        if with_password:
            parser.error(
                "--dsn: a password on the command line is visible to every user of this "
                "machine; set OUTBOX_DATABASE_URL, PGPASSWORD or a ~/.pgpass file instead"
            )
    else:
        args.dsn = os.environ.get("OUTBOX_DATABASE_URL")
    if not args.dsn:
        parser.error("name a server with --dsn or $OUTBOX_DATABASE_URL")
    try:
        if args.existing:
            with psycopg.connect(args.dsn) as conn:
                text = dump_existing(conn)
        else:
            text = scratch_dump(args.dsn)
    except (psycopg.Error, OutboxError) as exc:
        sys.stderr.write(f"schema_dump: {dsn_util.scrub(str(exc), args.dsn)}\n")
        return 1
    _write(text, args.output)
    return 0


if __name__ == "__main__":
    sys.exit(main())
