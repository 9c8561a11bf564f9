"""The wheels a GPU session carries, packed small: one ``.tar.xz`` of their unpacked files.

A device call carries 64 MiB in all, the working tree included. A wheel is a zip whose members
are deflated one by one; xz over the unpacked members of every wheel together is much smaller
(measured 2026-11-28: Ray 2.60 without Java/RLlib/Serve, nvshmem4py, the cuDNN frontend and
Ray Train's pure-Python dependencies, 59.3 MiB of wheels, pack into 31.3 MiB in about 2.5 min),
which leaves room for the tree to grow and for more wheels. ``gpu_session.sh`` rebuilds the wheels from the pack on
the GPU machine (uncompressed zips: pip reads them the same, and storing is fast) and installs
them as before.

Usage, from the project root::

    python bench/carry_wheels.py pack .whl .carry/wheels.tar.xz      # here, once the wheels exist
    python bench/carry_wheels.py unpack .carry/wheels.tar.xz /tmp/w  # there: /tmp/w/<name>.whl

Every wheel under the source folder is packed (subfolders kept: ``extra/cuda_core-*.whl`` comes
back as ``/tmp/w/extra/cuda_core-*.whl``). Each member keeps its bytes and its Unix mode (Ray's
executables stay executable), so the rebuilt wheel installs the same files as the original, whose
RECORD hashes pip checks.
"""

from __future__ import annotations

import argparse
import io
import lzma
import sys
import tarfile
import zipfile
from pathlib import Path

WHEEL_DIR_SUFFIX = ".whl"  # each wheel's members go under "<relative path of the wheel>/"


def pack(src: Path, dest: Path) -> tuple[int, int]:
    """Pack every wheel under ``src`` into ``dest`` (xz, preset 9 extreme); returns (bytes of the
    wheels, bytes of the pack).

    Raises:
        ValueError: ``src`` holds no wheel.
    """
    wheels = sorted(src.rglob("*.whl"))
    if not wheels:
        raise ValueError(f"no wheel under {src}")
    dest.parent.mkdir(parents=True, exist_ok=True)
    part = dest.with_name(dest.name + ".part")
    with tarfile.open(part, "w:xz", preset=9 | lzma.PRESET_EXTREME, format=tarfile.PAX_FORMAT) as tar:
        for wheel in wheels:
            root = wheel.relative_to(src).as_posix()
            with zipfile.ZipFile(wheel) as zf:
                for info in zf.infolist():
                    if info.is_dir():
                        continue
                    data = zf.read(info)
                    member = tarfile.TarInfo(f"{root}/{info.filename}")
                    member.size, member.mode = len(data), (info.external_attr >> 16) & 0o7777 or 0o644
                    tar.addfile(member, io.BytesIO(data))
    part.replace(dest)
    return sum(w.stat().st_size for w in wheels), dest.stat().st_size


def unpack(pack_path: Path, out: Path) -> list[Path]:
    """Rebuild the packed wheels under ``out`` (uncompressed zips, members in packed order);
    returns their paths.

    Raises:
        ValueError: a member outside any wheel, or a path that leaves the wheel.
    """
    out.mkdir(parents=True, exist_ok=True)
    zips: dict[str, zipfile.ZipFile] = {}
    try:
        with tarfile.open(pack_path, "r:xz") as tar:
            for member in tar:
                root, sep, name = member.name.partition(WHEEL_DIR_SUFFIX + "/")
                if not sep or not name or ".." in Path(name).parts or ".." in Path(root).parts:
                    raise ValueError(f"{pack_path}: member {member.name!r} is not a wheel's file")
                wheel = root + WHEEL_DIR_SUFFIX
                if wheel not in zips:
                    (out / wheel).parent.mkdir(parents=True, exist_ok=True)
                    zips[wheel] = zipfile.ZipFile(out / wheel, "w", zipfile.ZIP_STORED)
                info = zipfile.ZipInfo(name, date_time=(1980, 1, 1, 0, 0, 0))
                info.external_attr = (0o100000 | member.mode) << 16  # a regular file with its mode
                zips[wheel].writestr(info, tar.extractfile(member).read())
    finally:
        for zf in zips.values():
            zf.close()
    return [out / w for w in zips]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("pack", help="pack the wheels under SRC into DEST")
    p.add_argument("src", type=Path)
    p.add_argument("dest", type=Path)
    u = sub.add_parser("unpack", help="rebuild the wheels of PACK under OUT")
    u.add_argument("pack", type=Path)
    u.add_argument("out", type=Path)
    args = ap.parse_args(argv)
    if args.cmd == "pack":
        wheels, packed = pack(args.src, args.dest)
        print(f"{args.dest}: {wheels / 2**20:.1f} MiB of wheels -> {packed / 2**20:.1f} MiB")
    else:
        for path in unpack(args.pack, args.out):
            print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
