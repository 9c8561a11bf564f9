"""The GPU session's wheel pack (``bench/carry_wheels.py``): rebuilt wheels hold every member of
the originals with its bytes and Unix mode, under the same relative paths."""

from __future__ import annotations

import io
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import carry_wheels  # noqa: E402


def _wheel(path: Path, members: dict[str, tuple[bytes, int]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as zf:
        for name, (data, mode) in members.items():
            info = zipfile.ZipInfo(name)
            info.external_attr = (0o100000 | mode) << 16
            zf.writestr(info, data)


def _members(path: Path) -> dict[str, tuple[bytes, int]]:
    with zipfile.ZipFile(path) as zf:
        return {i.filename: (zf.read(i), (i.external_attr >> 16) & 0o7777) for i in zf.infolist()}


def test_packed_wheels_come_back_with_every_member_its_bytes_and_mode(tmp_path):
    wheels = {
        "ray-1.0-cp312-cp312-any.whl": {"ray/core/raylet": (b"\x7fELF" + bytes(range(256)) * 50, 0o755),
                                        "ray/__init__.py": (b"x = 1\n" * 100, 0o644),
                                        "ray-1.0.dist-info/RECORD": (b"ray/__init__.py,,\n", 0o644)},
        "extra/cuda_core-0.5-py3-none-any.whl": {"cuda/core/__init__.py": (b"", 0o644)},
    }
    src = tmp_path / "whl"
    for name, members in wheels.items():
        _wheel(src / name, members)
    raw, packed = carry_wheels.pack(src, tmp_path / "carry" / "wheels.tar.xz")
    assert raw == sum((src / n).stat().st_size for n in wheels) and packed < raw
    out = carry_wheels.unpack(tmp_path / "carry" / "wheels.tar.xz", tmp_path / "out")
    assert sorted(p.relative_to(tmp_path / "out").as_posix() for p in out) == sorted(wheels)
    for name, members in wheels.items():
        assert _members(tmp_path / "out" / name) == members


def test_an_empty_folder_or_a_stray_member_is_refused(tmp_path):
    with pytest.raises(ValueError, match="no wheel under"):
        carry_wheels.pack(tmp_path, tmp_path / "w.tar.xz")
    bad = tmp_path / "bad.tar.xz"
    with tarfile.open(bad, "w:xz") as tar:
        member = tarfile.TarInfo("a.whl/../../etc/passwd")
        member.size = 1
        tar.addfile(member, io.BytesIO(b"x"))
    with pytest.raises(ValueError, match="is not a wheel's file"):
        carry_wheels.unpack(bad, tmp_path / "out")
