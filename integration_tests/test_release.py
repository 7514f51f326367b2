"""tools/release.py: the seven distributions agree on version, pins, license and dependencies; the
bump moves them all at once; the dist/ check refuses what a package index or a user would trip on."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import io
import shutil
import sys
import tarfile
import zipfile
from collections.abc import Callable
from pathlib import Path

import pytest
import tomllib

ROOT = Path(__file__).resolve().parents[1]


def _load_release():
    spec = importlib.util.spec_from_file_location("deepinfer_release_under_test", ROOT / "tools" / "release.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


release = _load_release()
VERSION = release.current_version()


def _not_source(folder: str, names: list[str]) -> list[str]:
    """copytree's ignore: weights, compiled objects, caches; keeps .py, .pyx, .pxd and folders."""
    return [n for n in names if n == "__pycache__" or ("." in n and not n.endswith((".py", ".pyx", ".pxd")))]


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    """A copy of what the release tool reads: LICENSE files, pyproject.toml, CHANGELOG.md, sources."""
    root = tmp_path / "repo"
    (root / "packages").mkdir(parents=True)
    shutil.copy2(ROOT / "LICENSE", root / "LICENSE")
    for name in release.PACKAGES:
        source = ROOT / "packages" / f"deepinfer-{name}"
        target = root / "packages" / f"deepinfer-{name}"
        shutil.copytree(source / "src", target / "src", ignore=_not_source)
        for member in ("pyproject.toml", "CHANGELOG.md", "LICENSE", "README.md"):
            shutil.copy2(source / member, target / member)
    return root


def _edit(root: Path, relative: str, old: str, new: str) -> None:
    path = root / relative
    text = path.read_text(encoding="utf-8")
    assert old in text, f"{relative} no longer contains {old!r}: update this test"
    path.write_text(text.replace(old, new, 1), encoding="utf-8")


def _drop_line(root: Path, relative: str, prefix: str) -> None:
    path = root / relative
    lines = path.read_text(encoding="utf-8").splitlines(keepends=True)
    kept = [line for line in lines if not line.startswith(prefix)]
    assert len(kept) == len(lines) - 1, f"{relative} has no single line starting {prefix!r}: update this test"
    path.write_text("".join(kept), encoding="utf-8")


def _snapshot(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_the_sources_are_release_ready() -> None:
    assert release.check_sources() == []


def test_installed_distributions_carry_the_source_version() -> None:
    installed = {d.metadata["Name"]: d.version for d in importlib.metadata.distributions()
                 if d.metadata["Name"] and d.metadata["Name"].startswith("deepinfer-")}
    assert "deepinfer-engine" in installed
    stale = {name: version for name, version in installed.items() if version != VERSION}
    assert not stale, f"installed {stale}, sources at {VERSION}: reinstall (./dev.sh does when a pyproject changes)"


def test_every_package_ships_the_root_license_under_spdx_apache() -> None:
    for name in release.PACKAGES:
        package = ROOT / "packages" / f"deepinfer-{name}"
        project = tomllib.loads((package / "pyproject.toml").read_text(encoding="utf-8"))["project"]
        assert (project["license"], project["license-files"]) == ("Apache-2.0", ["LICENSE"]), name
        assert (package / "LICENSE").read_bytes() == (ROOT / "LICENSE").read_bytes(), name
    assert (ROOT / "LICENSE").read_text(encoding="utf-8").split()[:4] == ["Apache", "License", "Version", "2.0,"]


def test_engine_requires_only_the_siblings_it_imports() -> None:
    project = tomllib.loads((ROOT / "packages/deepinfer-engine/pyproject.toml").read_text(encoding="utf-8"))["project"]
    siblings = sorted(r for r in project["dependencies"] if r.startswith("deepinfer-"))
    assert siblings == sorted(f"deepinfer-{name}~={VERSION}"
                              for name in ("kernels", "model", "cache", "sched", "spec", "eplb"))


def test_bump_moves_every_version_pin_and_changelog_and_nothing_else(tree: Path) -> None:
    before = _snapshot(tree)
    rewritten = release.bump("9.8.7", root=tree)
    assert sorted(str(p.relative_to(tree)) for p in rewritten) == sorted(
        f"packages/deepinfer-{name}/{member}"
        for name in release.PACKAGES for member in ("pyproject.toml", "CHANGELOG.md"))
    assert release.current_version(tree) == "9.8.7"
    assert release.check_sources(tree) == []
    engine = tomllib.loads((tree / "packages/deepinfer-engine/pyproject.toml").read_text(encoding="utf-8"))
    assert [r for r in engine["project"]["dependencies"] if r.startswith("deepinfer-")] == [
        "deepinfer-kernels~=9.8.7", "deepinfer-model~=9.8.7", "deepinfer-cache~=9.8.7", "deepinfer-sched~=9.8.7",
        "deepinfer-spec~=9.8.7", "deepinfer-eplb~=9.8.7"]
    after = _snapshot(tree)
    for name in release.PACKAGES:
        pyproject = f"packages/deepinfer-{name}/pyproject.toml"
        assert after[pyproject].decode().replace("9.8.7", VERSION) == before[pyproject].decode(), name
        changelog = f"packages/deepinfer-{name}/CHANGELOG.md"
        title, rest = before[changelog].decode().split("\n\n", 1)
        assert after[changelog].decode() == f"{title}\n\n## 9.8.7 (unreleased)\n\n{rest}", name
    assert {k: v for k, v in after.items() if k not in before or v != before[k]}.keys() == {
        str(p.relative_to(tree)) for p in rewritten}


@pytest.mark.parametrize("version", [VERSION, "0.1.9", "0.2", "v9.0.0", "9.0.0rc1", "9.0.0 "])
def test_bump_refuses_a_malformed_or_non_increasing_version_and_writes_nothing(tree: Path, version: str) -> None:
    before = _snapshot(tree)
    with pytest.raises(release.ReleaseError):
        release.bump(version, root=tree)
    assert _snapshot(tree) == before


def test_bump_refuses_packages_out_of_step(tree: Path) -> None:
    _edit(tree, "packages/deepinfer-eplb/pyproject.toml", f'version = "{VERSION}"', 'version = "0.0.1"')
    before = _snapshot(tree)
    with pytest.raises(release.ReleaseError, match="disagree"):
        release.bump("9.0.0", root=tree)
    assert _snapshot(tree) == before
    problems = release.check_sources(tree)
    assert len(problems) == 1 and problems[0].startswith("the packages disagree on their version"), problems
    assert "'eplb': '0.0.1'" in problems[0]


TAMPERS: dict[str, tuple[Callable[[Path], None], str]] = {
    "license copy differs": (
        lambda root: (root / "packages/deepinfer-eplb/LICENSE").write_text("MIT\n"),
        "deepinfer-eplb: LICENSE is not a copy of the root LICENSE"),
    "pin not compatible-release": (
        lambda root: _edit(root, "packages/deepinfer-sched/pyproject.toml", f'"deepinfer-cache~={VERSION}"',
                           f'"deepinfer-cache>={VERSION}"'),
        f"deepinfer-sched: pin deepinfer-cache>={VERSION} is not deepinfer-cache~={VERSION}"),
    "sibling imported, not declared": (
        lambda root: (root / "packages/deepinfer-sched/src/deepinfer/sched/_balance.py").write_text(
            "def plan():\n    from deepinfer.eplb import rebalance_experts\n    return rebalance_experts\n"),
        "deepinfer-sched imports deepinfer.eplb but does not declare deepinfer-eplb"),
    "sibling declared, not imported": (
        lambda root: _edit(root, "packages/deepinfer-sched/pyproject.toml", '    "numpy>=',
                           f'    "deepinfer-spec~={VERSION}",\n    "numpy>='),
        "deepinfer-sched declares deepinfer-spec but never imports deepinfer.spec"),
    "third party declared, not imported": (
        lambda root: _edit(root, "packages/deepinfer-eplb/pyproject.toml", '    "numpy>=1.24",\n',
                           '    "numpy>=1.24",\n    "tqdm>=4.60",\n'),
        "deepinfer-eplb declares tqdm but never imports tqdm"),
    "another third party declared, not imported": (
        lambda root: _edit(root, "packages/deepinfer-spec/pyproject.toml", '    "torch>=2.11,<2.14",\n',
                           '    "torch>=2.11,<2.14",\n    "regex>=2024.1",\n'),
        "deepinfer-spec declares regex but never imports regex"),
    "license as a table": (
        lambda root: _edit(root, "packages/deepinfer-cache/pyproject.toml", 'license = "Apache-2.0"',
                           'license = { text = "Apache-2.0" }'),
        "deepinfer-cache: license must be the SPDX expression 'Apache-2.0'"),
    "license classifier": (
        lambda root: _edit(root, "packages/deepinfer-kernels/pyproject.toml", "classifiers = [\n",
                           'classifiers = [\n    "License :: OSI Approved :: Apache Software License",\n'),
        "deepinfer-kernels: classifier 'License :: OSI Approved :: Apache Software License'"),
    "old hatchling": (
        lambda root: _edit(root, "packages/deepinfer-spec/pyproject.toml", "hatchling>=1.27", "hatchling>=1.21"),
        "deepinfer-spec: build-system needs hatchling>=1.27"),
    "no keywords": (
        lambda root: _drop_line(root, "packages/deepinfer-model/pyproject.toml", "keywords = "),
        "deepinfer-model: project.keywords is missing"),
    "changelog not opened": (
        lambda root: _edit(root, "packages/deepinfer-engine/CHANGELOG.md", f"## {VERSION} (unreleased)", "## Next"),
        f"deepinfer-engine: CHANGELOG.md does not open with a section `## {VERSION}`"),
    "torch ranges differ": (
        lambda root: _edit(root, "packages/deepinfer-model/pyproject.toml", '"torch>=2.11,<2.14"', '"torch>=2.4"'),
        "the packages require different torch ranges"),
}


@pytest.mark.parametrize("case", sorted(TAMPERS))
def test_check_sources_names_what_is_wrong(tree: Path, case: str) -> None:
    tamper, expected = TAMPERS[case]
    tamper(tree)
    problems = release.check_sources(tree)
    assert len(problems) == 1 and problems[0].startswith(expected), problems


# --- dist/ -----------------------------------------------------------------------------------------

def _metadata(tree: Path, name: str, **override: str | None) -> str:
    """Core metadata as hatchling writes it for packages/deepinfer-<name>; override replaces or drops fields."""
    project = tomllib.loads((tree / f"packages/deepinfer-{name}/pyproject.toml").read_text(encoding="utf-8"))["project"]
    fields: list[tuple[str, str | None]] = [
        ("Metadata-Version", "2.4"), ("Name", f"deepinfer-{name}"), ("Version", project["version"]),
        ("Summary", project["description"]), ("Author", "DeepInfer maintainers"),
        ("License-Expression", "Apache-2.0"), ("License-File", "LICENSE"), ("Keywords", ",".join(project["keywords"])),
        *(("Classifier", c) for c in project["classifiers"]), ("Requires-Python", project["requires-python"]),
        *(("Requires-Dist", r) for r in project["dependencies"]), ("Provides-Extra", "test"),
        ("Requires-Dist", "pytest>=8; extra == 'test'"),
    ]
    lines = []
    for key, value in fields:
        value = override.get(key, value) if key in override else value
        if value is not None:
            lines.append(f"{key}: {value}")
    return "\n".join(lines) + "\n\nREADME\n"


def _write_wheel(dist: Path, tree: Path, name: str, tag: str | None = None, license_text: bytes | None = None,
                 python: str = "311", **override: str | None) -> Path:
    version = release.current_version(tree)
    tag = tag or (f"cp{python}-cp{python}-manylinux_2_17_x86_64.manylinux2014_x86_64" if name in release.COMPILED
                  else "py3-none-any")
    info = f"deepinfer_{name}-{version}.dist-info"
    path = dist / f"deepinfer_{name}-{version}-{tag}.whl"
    interpreters, abis, platforms = tag.split("-")
    wheel_tags = "".join(f"Tag: {i}-{a}-{p}\n" for i in interpreters.split(".") for a in abis.split(".")
                         for p in platforms.split("."))
    with zipfile.ZipFile(path, "w") as wheel:
        wheel.writestr(f"deepinfer/{name}/__init__.py", '"""docstring"""\n')
        if name in release.COMPILED:
            wheel.writestr(f"deepinfer/{name}/_core.cpython-{python}-x86_64-linux-gnu.so", b"\x7fELF")
        wheel.writestr(f"{info}/METADATA", _metadata(tree, name, **override))
        purelib = "false" if name in release.COMPILED else "true"
        wheel.writestr(f"{info}/WHEEL", f"Wheel-Version: 1.0\nRoot-Is-Purelib: {purelib}\n{wheel_tags}")
        wheel.writestr(f"{info}/licenses/LICENSE",
                       license_text if license_text is not None else (tree / "LICENSE").read_bytes())
        wheel.writestr(f"{info}/RECORD", "")
    return path


def _write_sdist(dist: Path, tree: Path, name: str, extra: tuple[str, ...] = ()) -> Path:
    version = release.current_version(tree)
    base = f"deepinfer_{name}-{version}"
    package = tree / f"packages/deepinfer-{name}"
    members = {"PKG-INFO": _metadata(tree, name).encode(), "LICENSE": (tree / "LICENSE").read_bytes()}
    for member in ("pyproject.toml", "README.md", "CHANGELOG.md", f"src/deepinfer/{name}/__init__.py"):
        members[member] = (package / member).read_bytes()
    if name in release.COMPILED:
        members["hatch_build.py"] = b"# hook\n"
        members.update({p.relative_to(package).as_posix(): p.read_bytes() for p in (package / "src").rglob("*.pyx")})
    members.update({member: b"" for member in extra})
    path = dist / f"{base}.tar.gz"
    with tarfile.open(path, "w:gz") as sdist:
        for member, data in members.items():
            entry = tarfile.TarInfo(f"{base}/{member}")
            entry.size = len(data)
            sdist.addfile(entry, io.BytesIO(data))
    return path


@pytest.fixture
def dist(tree: Path, tmp_path: Path) -> Path:
    folder = tmp_path / "dist"
    folder.mkdir()
    for name in release.PACKAGES:
        pythons = release.supported_pythons(name, tree) if name in release.COMPILED else ("3.11",)
        for python in pythons:
            _write_wheel(folder, tree, name, python=python.replace(".", ""))
        _write_sdist(folder, tree, name)
    return folder


def test_check_dist_accepts_one_sdist_per_package_and_a_wheel_per_classified_cpython(tree: Path,
                                                                                     dist: Path) -> None:
    assert release.supported_pythons("sched", tree) == ("3.10", "3.11", "3.12", "3.13")
    assert len(list(dist.iterdir())) == 7 + 5 + 2 * 4          # sdists, pure wheels, cp310-cp313 of cache, sched
    assert release.check_dist(dist, root=tree) == []


def _replace_wheel(dist: Path, tree: Path, name: str, **kwargs) -> None:
    """Replace a package's wheel (of a compiled one, the cp311 wheel)."""
    for old in dist.glob(f"deepinfer_{name}-*-cp311-*.whl" if name in release.COMPILED else f"deepinfer_{name}-*.whl"):
        old.unlink()
    _write_wheel(dist, tree, name, **kwargs)


DIST_TAMPERS: dict[str, tuple[Callable[[Path, Path], None], str]] = {
    "unrepaired linux wheel": (
        lambda dist, tree: _replace_wheel(dist, tree, "cache", tag="cp311-cp311-linux_x86_64"),
        f"deepinfer_cache-{VERSION}-cp311-cp311-linux_x86_64.whl: tag 'cp311-cp311-linux_x86_64' is not a manylinux"),
    "pure package with a platform tag": (
        lambda dist, tree: _replace_wheel(dist, tree, "eplb", tag="py311-none-any"),
        f"deepinfer_eplb-{VERSION}-py311-none-any.whl: tag 'py311-none-any', expected py3-none-any"),
    "no license expression": (
        lambda dist, tree: _replace_wheel(dist, tree, "engine", **{"License-Expression": None}),
        f"deepinfer_engine-{VERSION}-py3-none-any.whl: License-Expression is None"),
    "old metadata version": (
        lambda dist, tree: _replace_wheel(dist, tree, "spec", **{"Metadata-Version": "2.1"}),
        f"deepinfer_spec-{VERSION}-py3-none-any.whl: Metadata-Version 2.1 < 2.4"),
    "other license text": (
        lambda dist, tree: _replace_wheel(dist, tree, "model", license_text=b"MIT\n"),
        f"deepinfer_model-{VERSION}-py3-none-any.whl: the shipped LICENSE is missing or differs"),
    "requires-python not the pyproject's": (
        lambda dist, tree: _replace_wheel(dist, tree, "kernels", **{"Requires-Python": ">=3.8"}),
        f"deepinfer_kernels-{VERSION}-py3-none-any.whl: Requires-Python is '>=3.8'"),
    "requires-dist not the pyproject's": (
        lambda dist, tree: _replace_wheel(dist, tree, "engine", **{"Requires-Dist": f"deepinfer-spec~={VERSION}"}),
        # every Requires-Dist line replaced, the test extra's too
        f"deepinfer_engine-{VERSION}-py3-none-any.whl: Requires-Dist ['deepinfer-spec~={VERSION}', 'deepinfer-spec"),
    "stale wheel of an older version": (
        lambda dist, tree: (dist / "deepinfer_eplb-0.0.1-py3-none-any.whl").write_bytes(b""),
        "unexpected file deepinfer_eplb-0.0.1-py3-none-any.whl"),
    "sdist with generated C": (
        lambda dist, tree: _write_sdist(dist, tree, "sched", extra=("src/deepinfer/sched/_decode_core.c",)),
        f"deepinfer_sched-{VERSION}.tar.gz: ships the build output deepinfer_sched-{VERSION}/src/deepinfer/sched/"
        "_decode_core.c"),
    "a classified CPython without its wheel": (
        lambda dist, tree: next(dist.glob("deepinfer_sched-*-cp313-*.whl")).unlink(),
        f"expected one wheel deepinfer_sched-{VERSION}-cp3X-*.whl per classified CPython ['cp310', 'cp311', 'cp312', "
        "'cp313']"),
    "missing sdist": (
        lambda dist, tree: (dist / f"deepinfer_cache-{VERSION}.tar.gz").unlink(),
        f"deepinfer_cache-{VERSION}.tar.gz is missing"),
}


@pytest.mark.parametrize("case", sorted(DIST_TAMPERS))
def test_check_dist_names_what_is_wrong(tree: Path, dist: Path, case: str) -> None:
    tamper, expected = DIST_TAMPERS[case]
    tamper(dist, tree)
    problems = release.check_dist(dist, root=tree)
    assert len(problems) == 1 and problems[0].startswith(expected), problems


def test_cli_check_passes_on_the_repository(capsys: pytest.CaptureFixture[str]) -> None:
    assert release.main(["--check"]) == 0
    assert capsys.readouterr().out == f"sources: consistent, version {VERSION}\n"
