"""FlashQLA's wheels in one xz archive small enough to travel with a device call (issue 28's anchor).

Its seven py3.12 wheels (flash-qla 0.1.3, tilelang 0.1.15, apache-tvm-ffi, torch-c-dlpack-ext, z3-solver,
cloudpickle, ml-dtypes) plus psutil are ~83 MB as wheels (zip), over the 64 MiB a call carries beside the tree and
.whl/; unzipped and packed with xz -9 they are ~41 MB. ``pack`` writes ``.qla/qla.tar.xz`` from a folder of the
wheels; ``unpack`` (run by benchmarks/device.sh on the device) rebuilds each wheel from its unzipped files (the same
files, so RECORD's hashes hold) into a folder pip installs from with ``--no-index --find-links``.

    pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \\
        --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 -d /tmp/qla \\
        flash-qla==0.1.3 tilelang==0.1.15 "apache-tvm-ffi<0.1.13,>=0.1.11" torch-c-dlpack-ext z3-solver==4.15.4.0 \\
        cloudpickle ml-dtypes psutil
    python benchmarks/pack_qla.py pack /tmp/qla          # -> .qla/qla.tar.xz (carry [".whl", ".qla"])
    python3 benchmarks/pack_qla.py unpack .qla/qla.tar.xz /tmp/qla_whl     # on the device
"""
from __future__ import annotations

import io
import sys
import tarfile
import zipfile
from pathlib import Path


def pack(src: Path, out: Path) -> None:
    """Every wheel of ``src`` unzipped under its file name, in one tar.xz (preset 9 | extreme)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(out, "w:xz", preset=9 | 0x80000000) as tar:   # lzma.PRESET_EXTREME
        for whl in sorted(src.glob("*.whl")):
            with zipfile.ZipFile(whl) as z:
                for info in z.infolist():
                    if info.is_dir():
                        continue
                    data = z.read(info)
                    t = tarfile.TarInfo(f"{whl.name}/{info.filename}")
                    t.size, t.mode = len(data), (info.external_attr >> 16) or 0o644
                    tar.addfile(t, io.BytesIO(data))
    print(out, f"{out.stat().st_size / 2**20:.1f} MiB")


def unpack(archive: Path, dest: Path) -> None:
    """The wheels again: one zip per top-level folder of ``archive``, named as the folder."""
    dest.mkdir(parents=True, exist_ok=True)
    zips: dict[str, zipfile.ZipFile] = {}
    with tarfile.open(archive, "r:xz") as tar:
        for m in tar:
            if not m.isfile():
                continue
            whl, name = m.name.split("/", 1)
            if whl not in zips:
                zips[whl] = zipfile.ZipFile(dest / whl, "w", zipfile.ZIP_DEFLATED, compresslevel=1)
            zi = zipfile.ZipInfo(name)
            zi.external_attr = (0o100000 | (m.mode & 0o7777)) << 16     # S_IFREG: pip checks it is a file
            zi.compress_type = zipfile.ZIP_DEFLATED
            zips[whl].writestr(zi, tar.extractfile(m).read())
    for z in zips.values():
        z.close()
    print(dest, len(zips), "wheels")


if __name__ == "__main__":
    cmd, *rest = sys.argv[1:]
    if cmd == "pack":
        pack(Path(rest[0]), Path(rest[1]) if len(rest) > 1 else Path(".qla/qla.tar.xz"))
    elif cmd == "unpack":
        unpack(Path(rest[0]), Path(rest[1]))
    else:
        sys.exit(f"usage: {sys.argv[0]} pack WHEEL_DIR [OUT] | unpack ARCHIVE DEST")
