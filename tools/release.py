"""Version bump and release checks for the seven deepinfer-* distributions, which move together.

    python tools/release.py 0.2.1                 # every version, every sibling pin (~=0.2.1) and a
                                                  # "## 0.2.1 (unreleased)" section atop each CHANGELOG.md
    python tools/release.py --check               # the sources agree (see check_sources)
    python tools/release.py --check-dist dist     # the built sdists and wheels agree (see check_dist)

Versions are plain MAJOR.MINOR.PATCH. Sibling pins are compatible releases (`deepinfer-cache~=0.2.1`:
>= 0.2.1, == 0.2.*), so a patch release of one package serves the others. Every distribution ships
the root LICENSE as its own copy (packages/*/LICENSE, PEP 639 `license-files`); the check wants
them byte-identical. Needs Python >= 3.11 (tomllib) and `packaging`.
"""

from __future__ import annotations

import argparse
import ast
import email.message
import email.parser
import email.policy
import re
import sys
import tarfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

import tomllib
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("kernels", "model", "cache", "sched", "spec", "eplb", "engine")
COMPILED = frozenset({"cache", "sched"})  # Cython: manylinux wheels, the others py3-none-any
LICENSE_EXPRESSION = "Apache-2.0"
MIN_HATCHLING = Version("1.27")  # PEP 639 license expressions and license-files
# A dependency declared without being imported, allowed while the package imports the key:
# torch warns "Failed to initialize NumPy" at import without numpy.
IMPLIED_BY_IMPORT = {"numpy": "torch"}
# Siblings declared without being imported: deepinfer.sched's Scheduler takes two deepinfer.cache
# BlockManagers, checked by their interface, so the scheduler cannot run without deepinfer-cache.
USED_WITHOUT_IMPORT = {"sched": frozenset({"cache"})}

_VERSION = re.compile(r"\d+\.\d+\.\d+")
_VERSION_LINE = re.compile(r'^version = "([^"]*)"$', re.MULTILINE)
_SIBLING_LINE = re.compile(r'^(\s*)"(deepinfer-[a-z]+)[^"]*"(,?)$', re.MULTILINE)
_HEADING = re.compile(r"^## (\S+)", re.MULTILINE)
_CPYTHON_ABI = re.compile(r"cp3\d+-cp3\d+")
_MANYLINUX = re.compile(r"manylinux(_\d+_\d+|1|2010|2014)_x86_64")


class ReleaseError(Exception):
    """A bump that cannot be done (bad or non-increasing version, sources out of step)."""


def _dist_name(name: str) -> str:
    return f"deepinfer-{name}"


def _package_dir(root: Path, name: str) -> Path:
    return root / "packages" / _dist_name(name)


def _project(root: Path, name: str) -> dict:
    with open(_package_dir(root, name) / "pyproject.toml", "rb") as f:
        return tomllib.load(f)


def supported_pythons(name: str, root: Path = ROOT) -> tuple[str, ...]:
    """The CPython versions ("3.10", ...) that a package's classifiers name: for deepinfer-cache and
    deepinfer-sched, the interpreters dist/ must hold a wheel for (one each)."""
    prefix = "Programming Language :: Python :: 3."
    classifiers = _project(root, name)["project"].get("classifiers", ())
    return tuple(c.removeprefix("Programming Language :: Python :: ") for c in classifiers if c.startswith(prefix))


def current_version(root: Path = ROOT) -> str:
    """The one version every pyproject.toml declares; ReleaseError if they differ."""
    versions = {name: _project(root, name)["project"]["version"] for name in PACKAGES}
    if len(set(versions.values())) != 1:
        raise ReleaseError(f"the packages disagree on their version: {versions}")
    return next(iter(versions.values()))


def _version_key(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in version.split("."))


def bump(new_version: str, root: Path = ROOT) -> list[Path]:
    """Moves every package to new_version: version, sibling pins, a new changelog section on top.

    Args:
        new_version: MAJOR.MINOR.PATCH, greater than the current version.
        root: the repository root.

    Returns:
        The files rewritten (each pyproject.toml and CHANGELOG.md).

    Raises:
        ReleaseError: a malformed or non-increasing version, or a pyproject.toml without exactly one
            `version = "..."` line; nothing is written then.
    """
    if not _VERSION.fullmatch(new_version):
        raise ReleaseError(f"version {new_version!r} is not MAJOR.MINOR.PATCH")
    old_version = current_version(root)
    if _version_key(new_version) <= _version_key(old_version):
        raise ReleaseError(f"version {new_version} is not above the current {old_version}")
    rewritten: dict[Path, str] = {}
    for name in PACKAGES:
        pyproject = _package_dir(root, name) / "pyproject.toml"
        text = pyproject.read_text(encoding="utf-8")
        if len(_VERSION_LINE.findall(text)) != 1:
            raise ReleaseError(f"{pyproject}: expected exactly one line `version = \"...\"`")
        text = _VERSION_LINE.sub(f'version = "{new_version}"', text)
        text = _SIBLING_LINE.sub(lambda m: f'{m[1]}"{m[2]}~={new_version}"{m[3]}', text)
        rewritten[pyproject] = text
        changelog = _package_dir(root, name) / "CHANGELOG.md"
        text = changelog.read_text(encoding="utf-8")
        at = first.start() if (first := _HEADING.search(text)) else len(text)
        rewritten[changelog] = f"{text[:at]}## {new_version} (unreleased)\n\n{text[at:]}"
    for path, text in rewritten.items():
        path.write_text(text, encoding="utf-8")
    return list(rewritten)


def _imports(src: Path) -> set[str]:
    """Every absolute module name imported anywhere under src (lazy imports included)."""
    names: set[str] = set()
    for path in sorted(src.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_bytes(), filename=str(path))):
            if isinstance(node, ast.Import):
                names.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names.add(node.module)
                names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def _check_imports(root: Path, name: str, requirements: list[Requirement]) -> list[str]:
    """Declared siblings == imported siblings; every other runtime dependency is imported."""
    dist = _dist_name(name)
    imported = _imports(_package_dir(root, name) / "src")
    top_level = {module.split(".")[0] for module in imported}
    imported_siblings = {
        parts[1] for parts in (module.split(".") for module in imported)
        if len(parts) > 1 and parts[0] == "deepinfer" and parts[1] in PACKAGES and parts[1] != name
    }
    declared_siblings = {r.name[len("deepinfer-"):] for r in requirements if r.name.startswith("deepinfer-")}
    problems = [f"{dist} imports deepinfer.{s} but does not declare {_dist_name(s)}"
                for s in sorted(imported_siblings - declared_siblings)]
    unused = declared_siblings - imported_siblings - USED_WITHOUT_IMPORT.get(name, frozenset())
    problems += [f"{dist} declares {_dist_name(s)} but never imports deepinfer.{s}" for s in sorted(unused)]
    for requirement in requirements:
        module = requirement.name.replace("-", "_").lower()
        if requirement.name.startswith("deepinfer-") or module in top_level:
            continue
        if IMPLIED_BY_IMPORT.get(module) in top_level:
            continue
        problems.append(f"{dist} declares {requirement.name} but never imports {module}")
    return problems


def _check_project(root: Path, name: str, version: str) -> list[str]:
    """One pyproject.toml against the release rules."""
    dist = _dist_name(name)
    data = _project(root, name)
    project = data["project"]
    problems = []
    if project.get("name") != dist:
        problems.append(f"{dist}: project.name is {project.get('name')!r}")
    if project.get("version") != version:
        problems.append(f"{dist}: version {project.get('version')} != {version}")
    if project.get("license") != LICENSE_EXPRESSION:
        problems.append(f"{dist}: license must be the SPDX expression {LICENSE_EXPRESSION!r}")
    if project.get("license-files") != ["LICENSE"]:
        problems.append(f"{dist}: license-files must be [\"LICENSE\"]")
    for field in ("description", "readme", "requires-python", "authors", "keywords", "classifiers"):
        if not project.get(field):
            problems.append(f"{dist}: project.{field} is missing")
    problems += [f"{dist}: classifier {c!r} (the license expression replaces License :: classifiers)"
                 for c in project.get("classifiers", ()) if c.startswith("License ::")]
    hatchling = [Requirement(r) for r in data["build-system"]["requires"] if r.startswith("hatchling")]
    if not hatchling or not hatchling[0].specifier or any(
            not spec.operator == ">=" or Version(spec.version) < MIN_HATCHLING for spec in hatchling[0].specifier):
        problems.append(f"{dist}: build-system needs hatchling>={MIN_HATCHLING} (PEP 639 license fields)")
    requirements = [Requirement(r) for r in project.get("dependencies", ())]
    for requirement in requirements:
        if requirement.name.startswith("deepinfer-") and str(requirement.specifier) != f"~={version}":
            problems.append(f"{dist}: pin {requirement} is not {requirement.name}~={version}")
    problems += _check_imports(root, name, requirements)
    license_copy = _package_dir(root, name) / "LICENSE"
    if not license_copy.is_file() or license_copy.read_bytes() != (root / "LICENSE").read_bytes():
        problems.append(f"{dist}: LICENSE is not a copy of the root LICENSE (cp LICENSE {license_copy.parent}/)")
    changelog = _package_dir(root, name) / "CHANGELOG.md"
    heading = _HEADING.search(changelog.read_text(encoding="utf-8")) if changelog.is_file() else None
    if heading is None or heading[1] != version:
        problems.append(f"{dist}: CHANGELOG.md does not open with a section `## {version}`")
    return problems


def check_sources(root: Path = ROOT) -> list[str]:
    """What is wrong with the sources, one line each; [] when ready to build.

    Checked: one version for all seven; sibling pins `~=` that version; the same torch range
    wherever torch is required; SPDX license and license-files, authors, keywords, classifiers;
    hatchling >= 1.27; each packages/*/LICENSE equal to the root LICENSE; each CHANGELOG.md opening
    with that version; the siblings each package declares equal to those its src/ imports, and
    every other runtime dependency imported (numpy may ride along with torch).
    """
    if not (root / "LICENSE").is_file():
        return ["no LICENSE at the repository root"]
    try:
        version = current_version(root)
    except ReleaseError as error:
        return [str(error)]
    problems = []
    torch_ranges = {}
    for name in PACKAGES:
        problems += _check_project(root, name, version)
        for requirement in _project(root, name)["project"].get("dependencies", ()):
            if Requirement(requirement).name == "torch":
                torch_ranges[name] = str(Requirement(requirement).specifier)
    if len(set(torch_ranges.values())) > 1:
        problems.append(f"the packages require different torch ranges: {torch_ranges}")
    return problems


@dataclass(frozen=True, slots=True)
class _Metadata:
    fields: email.message.Message
    license_text: bytes | None


def _parse_metadata(raw: bytes, license_text: bytes | None) -> _Metadata:
    return _Metadata(email.parser.BytesParser(policy=email.policy.compat32).parsebytes(raw), license_text)


def _canonical(requirement: str) -> str:
    """A requirement with its name in canonical form (PEP 503: "Foo_Bar" -> "foo-bar"), as built
    metadata may spell it differently from pyproject.toml."""
    parsed = Requirement(requirement)
    parsed.name = canonicalize_name(parsed.name)
    return str(parsed)


def _check_metadata(root: Path, name: str, version: str, where: str, meta: _Metadata) -> list[str]:
    """Core metadata of one built distribution against its pyproject.toml."""
    project = _project(root, name)["project"]
    fields = meta.fields
    problems = []
    expected = {
        "Name": _dist_name(name),
        "Version": version,
        "License-Expression": LICENSE_EXPRESSION,
        "Summary": project["description"],
        "Requires-Python": project["requires-python"],
    }
    for field, value in expected.items():
        if fields.get(field) != value:
            problems.append(f"{where}: {field} is {fields.get(field)!r}, expected {value!r}")
    if Version(fields.get("Metadata-Version", "0")) < Version("2.4"):
        problems.append(f"{where}: Metadata-Version {fields.get('Metadata-Version')} < 2.4 (no PEP 639)")
    if fields.get_all("License-File") != ["LICENSE"]:
        problems.append(f"{where}: License-File is {fields.get_all('License-File')}, expected ['LICENSE']")
    if meta.license_text != (root / "LICENSE").read_bytes():
        problems.append(f"{where}: the shipped LICENSE is missing or differs from the root LICENSE")
    if sorted(fields.get_all("Classifier") or ()) != sorted(project["classifiers"]):
        problems.append(f"{where}: classifiers differ from pyproject.toml")
    if not fields.get("Keywords") or not (fields.get("Author") or fields.get("Author-email")):
        problems.append(f"{where}: Keywords or Author missing")
    runtime = sorted(_canonical(r) for r in fields.get_all("Requires-Dist") or () if "extra ==" not in r)
    declared = sorted(_canonical(r) for r in project.get("dependencies", ()))
    if runtime != declared:
        problems.append(f"{where}: Requires-Dist {runtime} != pyproject dependencies {declared}")
    return problems


def _check_wheel(root: Path, name: str, version: str, path: Path) -> list[str]:
    stem = f"deepinfer_{name}-{version}"
    tag = path.name[len(stem) + 1: -len(".whl")]
    problems = []
    if name in COMPILED:
        interpreter_abi, _, platforms = tag.rpartition("-")
        if not _CPYTHON_ABI.fullmatch(interpreter_abi) or not all(
                _MANYLINUX.fullmatch(platform) for platform in platforms.split(".")):
            problems.append(f"{path.name}: tag {tag!r} is not a manylinux one (run auditwheel repair)")
    elif tag != "py3-none-any":
        problems.append(f"{path.name}: tag {tag!r}, expected py3-none-any")
    with zipfile.ZipFile(path) as wheel:
        files = set(wheel.namelist())
        info = f"{stem}.dist-info"
        if f"{info}/METADATA" not in files:
            return problems + [f"{path.name}: no {info}/METADATA"]
        license_name = f"{info}/licenses/LICENSE"
        meta = _parse_metadata(wheel.read(f"{info}/METADATA"),
                               wheel.read(license_name) if license_name in files else None)
        wheel_info = email.parser.BytesParser(policy=email.policy.compat32).parsebytes(wheel.read(f"{info}/WHEEL"))
        if set(wheel_info.get_all("Tag") or ()) != _expand_tags(tag):
            problems.append(f"{path.name}: WHEEL tags {wheel_info.get_all('Tag')} do not match the file name")
        if (wheel_info.get("Root-Is-Purelib") == "true") == (name in COMPILED):
            problems.append(f"{path.name}: Root-Is-Purelib is {wheel_info.get('Root-Is-Purelib')}")
        native = [f for f in files if f.startswith(f"deepinfer/{name}/") and f.endswith(".so")]
        if (name in COMPILED) != bool(native):
            problems.append(f"{path.name}: compiled modules {native}")
        if f"deepinfer/{name}/__init__.py" not in files or "deepinfer/__init__.py" in files:
            problems.append(f"{path.name}: expected deepinfer/{name}/__init__.py under a namespace deepinfer/")
    return problems + _check_metadata(root, name, version, path.name, meta)


def _expand_tags(tag: str) -> set[str]:
    """`cp311-cp311-manylinux_2_17_x86_64.manylinux2014_x86_64` -> its compressed tag set."""
    interpreters, abis, platforms = tag.split("-")
    return {f"{i}-{a}-{p}" for i in interpreters.split(".") for a in abis.split(".") for p in platforms.split(".")}


def _check_sdist(root: Path, name: str, version: str, path: Path) -> list[str]:
    base = f"deepinfer_{name}-{version}"
    with tarfile.open(path) as sdist:
        files = set(sdist.getnames())

        def read(member: str) -> bytes | None:
            if member not in files:
                return None
            extracted = sdist.extractfile(member)
            return extracted.read() if extracted else None

        pkg_info = read(f"{base}/PKG-INFO")
        if pkg_info is None:
            return [f"{path.name}: no {base}/PKG-INFO"]
        problems = _check_metadata(root, name, version, path.name, _parse_metadata(pkg_info, read(f"{base}/LICENSE")))
    needed = [f"{base}/{member}" for member in
              ("pyproject.toml", "README.md", "CHANGELOG.md", f"src/deepinfer/{name}/__init__.py")]
    if name in COMPILED:
        needed.append(f"{base}/hatch_build.py")
        needed += [f"{base}/{p.relative_to(_package_dir(root, name)).as_posix()}"
                   for p in sorted((_package_dir(root, name) / "src").rglob("*.pyx"))]
    problems += [f"{path.name}: {member} is missing" for member in needed if member not in files]
    problems += [f"{path.name}: ships the build output {member}" for member in sorted(files)
                 if member.endswith((".so", ".c", ".pyc"))]
    return problems


def check_dist(dist: Path, root: Path = ROOT) -> list[str]:
    """What is wrong with the distributions in `dist`, one line each; [] when ready to publish.

    dist must hold exactly one sdist and one wheel per package at the current version: wheels
    `py3-none-any`, except deepinfer-cache and deepinfer-sched, which have one `cp3X-cp3X-manylinux_*_x86_64`
    wheel per CPython their classifiers name (`supported_pythons`) and no other;
    their core metadata (Metadata-Version >= 2.4, License-Expression, License-File, classifiers,
    Requires-Dist) must match pyproject.toml and the shipped LICENSE the root one; sdists must carry
    what a build from source needs (the Cython sources and hook, no generated C or objects).
    """
    version = current_version(root)
    problems = []
    seen: set[str] = set()
    for name in PACKAGES:
        stem = f"deepinfer_{name}-{version}"
        sdist = dist / f"{stem}.tar.gz"
        wheels = sorted(dist.glob(f"{stem}-*.whl"))
        if not sdist.is_file():
            problems.append(f"{sdist.name} is missing")
        else:
            problems += _check_sdist(root, name, version, sdist)
            seen.add(sdist.name)
        if name in COMPILED:
            tags = sorted(w.name[len(stem) + 1:].split("-")[0] for w in wheels)
            want = sorted(f"cp{v.replace('.', '')}" for v in supported_pythons(name, root))
            if tags != want:
                problems.append(f"expected one wheel {stem}-cp3X-*.whl per classified CPython {want}, found "
                                f"{[w.name for w in wheels]}")
        elif len(wheels) != 1:
            problems.append(f"expected one wheel {stem}-*.whl, found {[w.name for w in wheels]}")
        for wheel in wheels:
            problems += _check_wheel(root, name, version, wheel)
            seen.add(wheel.name)
    problems += [f"unexpected file {p.name} (stale build?)" for p in sorted(dist.iterdir()) if p.name not in seen]
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    group = parser.add_mutually_exclusive_group(required=True)
    group.add_argument("version", nargs="?", help="new MAJOR.MINOR.PATCH for every package")
    group.add_argument("--check", action="store_true", help="check the sources")
    group.add_argument("--check-dist", type=Path, metavar="DIR", help="check the sdists and wheels in DIR")
    args = parser.parse_args(argv)
    if args.version:
        try:
            changed = bump(args.version)
        except ReleaseError as error:
            print(f"release.py: {error}", file=sys.stderr)
            return 1
        for path in changed:
            print(f"rewrote {path.relative_to(ROOT)}")
        print(f"now write what {args.version} brings under each new CHANGELOG section")
        return 0
    try:
        problems = check_sources() if args.check else check_dist(args.check_dist)
    except ReleaseError as error:
        problems = [str(error)]
    for problem in problems:
        print(problem, file=sys.stderr)
    what = "sources" if args.check else str(args.check_dist)
    if problems:
        print(f"{what}: {len(problems)} problem(s)", file=sys.stderr)
        return 1
    print(f"{what}: consistent, version {current_version()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
