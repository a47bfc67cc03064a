"""Schema linking by lexical retrieval on Chinook: keywords, scores over names and values,
join keys kept, and the prompt rendering."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from hexgen_sql.schema import (
    Schema,
    extract_keywords,
    link_schema,
    name_tokens,
    read_schema,
    render_schema,
    stem,
)
from sql_fixtures import chinook_db_fixture  # noqa: F401


@pytest.fixture(name="schema", scope="module")
def schema_fixture(chinook_db: Path) -> Schema:
    return read_schema(chinook_db)


def test_keywords() -> None:
    assert extract_keywords("Which artists have albums?") == ["artist", "album"]
    assert extract_keywords("List all tracks by AC/DC") == ["track", "ac/dc"]
    assert extract_keywords('Songs on the playlist "Heavy Metal Classic" since 2009') == [
        "heavy metal classic",
        "song",
        "playlist",
        "since",
        "2009",
    ]
    assert extract_keywords("What albums did Iron Maiden release in 2.5 years?") == [
        "iron maiden",
        "album",
        "iron",
        "maiden",
        "release",
        "2.5",
        "year",
    ]
    assert extract_keywords("Which countries' customers spent the most?") == [
        "country",
        "customer",
        "spent",
    ]


def test_stem_and_name_tokens() -> None:
    assert [stem(w) for w in ["countries", "addresses", "tracks", "status", "bus", "boxes"]] == [
        "country",
        "address",
        "track",
        "status",
        "bus",
        "box",
    ]
    assert name_tokens("InvoiceLine") == ["invoice", "line"]
    assert name_tokens("MediaTypeId") == ["media", "type", "id"]
    assert name_tokens("billing_postal_codes") == ["billing", "postal", "code"]
    assert name_tokens("HTTPStatus") == ["http", "status"]


def test_read_schema(schema: Schema) -> None:
    assert [t.name for t in schema.tables] == [
        "Artist",
        "Album",
        "Genre",
        "MediaType",
        "Track",
        "Playlist",
        "PlaylistTrack",
        "Employee",
        "Customer",
        "Invoice",
        "InvoiceLine",
    ]
    album = schema.table("album")
    assert album.primary_key == ("AlbumId",)
    assert [(fk.column, fk.ref_table, fk.ref_column) for fk in album.foreign_keys] == [
        ("ArtistId", "Artist", "ArtistId")
    ]
    assert schema.table("PlaylistTrack").primary_key == ("PlaylistId", "TrackId")
    name = schema.table("Artist").column("Name")
    assert name.is_text
    assert name.samples == ("AC/DC", "Accept", "Aerosmith")
    assert name.values["ac/dc"] == "AC/DC"
    assert not schema.table("Track").column("Milliseconds").samples
    assert schema.table("Track").column("UnitPrice").type == "NUMERIC(10,2)"


def test_artists_with_albums(schema: Schema) -> None:
    linked = link_schema(schema, extract_keywords("Which artists have albums?"))
    assert set(linked.table_names) == {"Artist", "Album"}
    assert [(fk.table, fk.column, fk.ref_table) for fk in linked.foreign_keys] == [
        ("Album", "ArtistId", "Artist")
    ]


def test_tracks_by_a_band_link_through_values_and_joins(schema: Schema) -> None:
    linked = link_schema(schema, extract_keywords("List all tracks by AC/DC"))
    assert {"Track", "Album", "Artist"} <= set(linked.table_names)
    artist = next(t for t in linked.tables if t.table.name == "Artist")
    assert artist.matched_values == {"Name": ("AC/DC",)}
    assert any("ac/dc (value)" in reason for reason in artist.reasons)
    album = next(t for t in linked.tables if t.table.name == "Album")
    assert album.reasons == ("join",)
    joins = {(fk.table, fk.ref_table) for fk in linked.foreign_keys}
    assert {("Track", "Album"), ("Album", "Artist")} <= joins


@pytest.mark.parametrize(
    ("question", "expected"),
    [
        ("How many rock tracks are there?", {"Track", "Genre"}),
        ("Which employees support customers from Brazil?", {"Employee", "Customer"}),
        ('How many tracks are on the playlist "Grunge"?', {"Playlist", "PlaylistTrack", "Track"}),
        ("What is the average invoice total?", {"Invoice"}),
        ("Which customers bought tracks of the Jazz genre?", {"Customer", "Genre", "Track"}),
    ],
)
def test_linking_finds_the_tables(schema: Schema, question: str, expected: set[str]) -> None:
    linked = link_schema(schema, extract_keywords(question))
    assert expected <= set(linked.table_names)
    # the chosen tables are connected: every table but the first is joined to another
    names = set(linked.table_names)
    for name in names - {linked.table_names[0]}:
        assert any(name in (fk.table, fk.ref_table) for fk in linked.foreign_keys), name
    assert all(fk.table in names and fk.ref_table in names for fk in linked.foreign_keys)


def test_jazz_customers_are_joined_through_invoices(schema: Schema) -> None:
    linked = link_schema(
        schema, extract_keywords("Which customers bought tracks of the Jazz genre?")
    )
    assert {"Invoice", "InvoiceLine"} <= set(linked.table_names)


def test_top_k_and_column_pruning(schema: Schema) -> None:
    keywords = extract_keywords("What is the total of the invoices billed to each country?")
    linked = link_schema(schema, keywords, top_k=1, column_top_k=1)
    assert linked.table_names == ("Invoice",)
    columns = [c.name for c in linked.tables[0].columns]
    assert "InvoiceId" in columns  # keys are always kept
    assert len(columns) == 2


def test_nothing_matches_gives_the_whole_schema(schema: Schema) -> None:
    linked = link_schema(schema, extract_keywords("zzz qqq"))
    assert len(linked.tables) == len(schema.tables)


def test_render_schema(schema: Schema) -> None:
    text = render_schema(link_schema(schema, extract_keywords("List all tracks by AC/DC")))
    assert "CREATE TABLE Artist (\n  ArtistId INTEGER PRIMARY KEY,\n" in text
    assert "  Name NVARCHAR(120) -- e.g. 'AC/DC', 'Accept', 'Aerosmith'\n);" in text
    assert "  ArtistId INTEGER REFERENCES Artist(ArtistId)" in text
    whole = render_schema(schema)
    assert whole.count("CREATE TABLE") == 11
    assert "PRIMARY KEY (PlaylistId, TrackId)" in whole
    # rendered DDL is valid SQLite once the sample comments are gone
    conn = sqlite3.connect(":memory:")
    conn.executescript(whole)
    assert conn.execute("SELECT count(*) FROM sqlite_master WHERE type = 'table'").fetchone() == (
        11,
    )


def test_matched_values_come_first_in_the_samples(schema: Schema) -> None:
    text = render_schema(link_schema(schema, extract_keywords('albums by "Iron Maiden"')))
    assert "Name NVARCHAR(120) -- e.g. 'Iron Maiden', 'AC/DC', 'Accept'" in text


def test_read_schema_of_a_small_database(tmp_path: Path) -> None:
    path = tmp_path / "s.db"
    conn = sqlite3.connect(path)
    conn.executescript(
        """
        CREATE TABLE owner (id INTEGER PRIMARY KEY, full_name TEXT);
        CREATE TABLE pet (pet_id INTEGER PRIMARY KEY, pet_name VARCHAR(20),
                          owner_id INTEGER REFERENCES owner);
        INSERT INTO owner VALUES (1, 'Ada'), (2, 'Bob');
        INSERT INTO pet VALUES (1, 'Rex', 1), (2, 'Tom''s cat', 2);
        """
    )
    conn.commit()
    conn.close()
    schema = read_schema(path, samples=1, max_values=1)
    pet = schema.table("pet")
    assert pet.foreign_keys[0].ref_column == "id"  # implicit: the referenced primary key
    assert pet.column("pet_name").samples == ("Rex",)
    assert pet.column("pet_name").values == {}  # more distinct values than the cap
    linked = link_schema(schema, extract_keywords("Names of the owners of pets"))
    assert set(linked.table_names) == {"owner", "pet"}
    assert "'Rex'" in render_schema(linked)


def test_possessives_are_dropped() -> None:
    assert extract_keywords("Which sales support agent's customers spent most?") == [
        "sale",
        "support",
        "agent",
        "customer",
        "spent",
    ]


def test_linking_recall_over_the_question_set(schema: Schema) -> None:
    """Lexical linking finds every table of the gold query for at least 90% of the shipped
    questions (the misses need meaning: "revenue", "purchased" -> invoices) and keeps the
    prompt small."""
    import re

    from hexgen_sql.questions import load_questions

    names = {t.name.lower(): t.name for t in schema.tables}
    questions = load_questions()
    found = 0
    sizes = []
    for question in questions:
        gold = {
            names[word.lower()]
            for word in re.findall(r"(?:FROM|JOIN)\s+(\w+)", question.sql, re.IGNORECASE)
            if word.lower() in names
        }
        linked = link_schema(schema, extract_keywords(question.question))
        found += gold <= set(linked.table_names)
        sizes.append(len(linked.tables))
    assert found >= 0.9 * len(questions)
    assert sum(sizes) / len(sizes) <= 4


def test_a_self_join_keeps_its_key(schema: Schema) -> None:
    linked = link_schema(schema, extract_keywords("Which employee does each employee report to?"))
    assert linked.table_names[0] == "Employee"
    assert ("Employee", "ReportsTo", "Employee", "EmployeeId") in {
        (fk.table, fk.column, fk.ref_table, fk.ref_column) for fk in linked.foreign_keys
    }
    assert "ReportsTo INTEGER REFERENCES Employee(EmployeeId)" in render_schema(linked)
