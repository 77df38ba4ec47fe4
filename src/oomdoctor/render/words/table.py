"""One table per kind of id (issue 53 item 2): each id of the core's (a ``Literal`` the type checker knows) has here
one row, :class:`Words`: what the id means (``description``), how it is said where one template says it (``text``, a
``str.format`` template over the values the id comes with), and the names it had before (``old_names``), as pylint's
message table keeps a renamed message's old names.

The core holds ids and numbers only; it describes none. :func:`table` builds a kind's table from the core's ids and
refuses, when the module is imported, a table that misses an id, has one the core does not, or gives an old name
that is a current id or appears twice: a missing row fails every command and every test, not one sentence later.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TypeVar

Id = TypeVar("Id", bound=str)


@dataclass(frozen=True, kw_only=True)
class Words:
    """One id's row.

    Attributes:
        description: what the id means, for the reader of the JSON, the docs and the code (never a template); None
            where its ``text`` says it whole.
        text: the words the renderers say for it, a ``str.format`` template over its values (``{bytes:bytes}`` etc.,
            :func:`oomdoctor.render.format.fill`); None where a function composes them from several ids or numbers.
    One of the two at least.
        old_names: the names the id had before it was renamed, newest first: :func:`current_id` maps them to it.
    """

    description: str | None = None
    text: str | None = None
    old_names: tuple[str, ...] = ()


class TableError(ValueError):
    """A words table does not match its kind's ids (a programming error, found at import)."""


def table(kind: str, ids: Iterable[Id], rows: Mapping[Id, Words]) -> dict[Id, Words]:
    """The table of ``kind``: ``rows`` in the order of ``ids`` (the core's, ``typing.get_args`` of its ``Literal``).

    Raises:
        TableError: an id of ``ids`` has no row, a row has no id of ``ids``, a row has neither a description nor
            words, or an old name is a current id or is given twice.
    """
    order = list(ids)
    missing = [i for i in order if i not in rows]
    extra = [i for i in rows if i not in order]
    if missing or extra:
        raise TableError(f"{kind}: words missing for {missing}, words for ids that are not {kind}'s: {extra}")
    empty = [i for i in order if not (rows[i].description or rows[i].text or "").strip()]
    if empty:
        raise TableError(f"{kind}: neither a description nor words for {empty}")
    old = [o for i in order for o in rows[i].old_names]
    bad = sorted({o for o in old if o in rows or old.count(o) > 1})
    if bad:
        raise TableError(f"{kind}: old names that are current ids or given twice: {bad}")
    return {i: rows[i] for i in order}


def current_id(rows: Mapping[Id, Words], name: str) -> Id | None:
    """``name`` if it is an id of ``rows``, the id it was renamed to if it is an old name, else None (a JSON written
    by an older version read back)."""
    for i, w in rows.items():
        if i == name or name in w.old_names:
            return i
    return None


def meaning(rows: Mapping[Id, Words], id_: Id) -> str:
    """What ``id_`` means: its description, or its words where they say it whole. Raises KeyError for an unknown id."""
    w = rows[id_]
    return w.description or w.text or ""


def text(rows: Mapping[Id, Words], id_: Id) -> str:
    """The template ``rows`` says ``id_`` with.

    Raises:
        KeyError: ``id_`` is not an id of ``rows``, or its words are composed by a function (no ``text``).
    """
    said = rows[id_].text
    if said is None:
        raise KeyError(f"{id_}: said by a function, not one template")
    return said
