"""The KAI-Scheduler source archive as a build component: found beside the checkout, keyed by its bytes and the Go
version, unpacked safely, refused with a clear error when it is not what it claims."""

from __future__ import annotations

import io
import tarfile
from pathlib import Path

import pytest

from kai_isolator.services.devcluster import build


def _archive(path: Path, files: dict[str, str]) -> Path:
    with tarfile.open(path, "w:gz") as tar:
        for name, text in files.items():
            data = text.encode()
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


def _source(archive: Path) -> build.SourceArchive:
    return build.SourceArchive("kai-scheduler", archive, build.KAI_MODULE, f"{build.KAI_MODULE}/pkg/scheduler/version", build.KAI_PROGRAMS)


def test_the_archive_named_by_the_environment_is_used(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    archive = _archive(tmp_path / "kai-scheduler-abc1234.tar.gz", {"kai-scheduler/go.mod": f"module {build.KAI_MODULE}\n"})
    monkeypatch.setenv(build.KAI_SOURCE_ENV, str(archive))
    source = build.kai_source()
    assert source.archive == archive and source.version == "abc1234"


def test_the_digest_follows_the_archive_bytes(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    one = _source(_archive(tmp_path / "a" / "kai-scheduler-abc1234.tar.gz", {"kai-scheduler/go.mod": "module x\n"}))
    (tmp_path / "b").mkdir()
    other = _source(_archive(tmp_path / "b" / "kai-scheduler-abc1234.tar.gz", {"kai-scheduler/go.mod": "module y\n"}))
    assert one.digest() != other.digest() and one.digest() == _source(one.archive).digest()
    assert build.kai_entry(one).name.startswith("kai-scheduler-abc1234-")


def test_an_archive_of_another_module_is_refused(tmp_path: Path) -> None:
    source = _source(_archive(tmp_path / "kai-scheduler-abc1234.tar.gz", {"kai-scheduler/go.mod": "module example.com/other\n"}))
    with pytest.raises(build.BuildError, match="declares example.com/other"):
        build._unpack(source, tmp_path / "out")


def test_an_archive_that_escapes_its_folder_is_refused(tmp_path: Path) -> None:
    source = _source(_archive(tmp_path / "kai-scheduler-abc1234.tar.gz", {"../outside": "x", "kai-scheduler/go.mod": f"module {build.KAI_MODULE}\n"}))
    with pytest.raises(tarfile.TarError):
        build._unpack(source, tmp_path / "out")
    assert not (tmp_path / "outside").exists()


def test_bad_names_and_unknown_programs_say_what_is_wrong(tmp_path: Path) -> None:
    with pytest.raises(build.BuildError, match="kai-scheduler-<commit>.tar.gz"):
        _ = _source(tmp_path / "kai.tgz").version
    with pytest.raises(build.BuildError, match="no KAI-Scheduler source archive"):
        _source(tmp_path / "kai-scheduler-abc1234.tar.gz").digest()
    with pytest.raises(build.BuildError, match="has no program operator"):
        _source(tmp_path / "kai-scheduler-abc1234.tar.gz").packages(("admission", "operator"))


def test_usage_names_the_kai_option(capsys: pytest.CaptureFixture[str]) -> None:
    assert build.main(["--bogus"]) == 2
    printed = capsys.readouterr()
    assert printed.out == ""
    [usage] = printed.err.splitlines()
    assert usage.startswith("usage: python -m kai_isolator.services.devcluster.build ") and "--kai [PROGRAM...]" in usage, usage
